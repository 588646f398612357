"""README and BENCHMARKS quote the demo's results from docs/demo_results.json, the record `make demo-seeds` writes
with the date, command, machine and commit of each run: a number edited by hand, or a results file re-recorded
without re-rendering the documents, fails here."""
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("demo_seeds", REPO / "scripts" / "demo_seeds.py")
demo_seeds = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo_seeds)


def test_readme_and_benchmarks_quote_the_recorded_demo_results():
    results = json.loads((REPO / "docs" / "demo_results.json").read_text())
    assert {r["seed"] for r in results["runs"]} >= {0, 1, 2} and results["date"] and results["commit"]
    assert demo_seeds.readme_block(results) in (REPO / "README.md").read_text()
    assert demo_seeds.table(results) in (REPO / "BENCHMARKS.md").read_text()


def test_a_changed_number_is_caught():
    results = json.loads((REPO / "docs" / "demo_results.json").read_text())
    results["runs"][0]["judges"]["reference"]["win_rate"] += 0.01
    assert demo_seeds.readme_block(results) not in (REPO / "README.md").read_text()
