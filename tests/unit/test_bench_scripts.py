"""Every benchmark script imports and parses its arguments in the project's environment (the peers they compare
against are imported only inside their workers): a renamed helper breaks a bench here, not in a GPU lease."""
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py") if p.name != "common.py"))
def test_bench_script_starts(script):
    done = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
