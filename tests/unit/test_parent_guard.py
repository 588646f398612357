"""A stage the launcher started itself (one process, no torchrun agent between them) ends when its launcher dies
outright (kill -9, the OOM killer): SIGTERM from the guard, then SIGKILL after a grace for a stage that ignores it."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

STAGE = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stage that does not unwind (stuck in a C call)
    from rlaif.orchestration.parent_guard import kill_when_orphaned
    kill_when_orphaned(grace_s=1.0)
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(600)
""")
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from rlaif.orchestration.parent_guard import LAUNCHER_PID, guarded
    subprocess.Popen(guarded([sys.executable, "-c", sys.argv[1], sys.argv[2]]),
                     env=dict(os.environ, **{LAUNCHER_PID: str(os.getpid())}))
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie nobody reaped has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stage_that_ignores_sigterm_is_killed_after_its_launcher_dies(tmp_path):
    pid_file = tmp_path / "stage.pid"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, STAGE, str(pid_file)])
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline and launcher.poll() is None, "the stage did not start"
        time.sleep(0.1)
    stage = int(pid_file.read_text())
    try:
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 30
        while alive(stage) and time.time() < deadline:
            time.sleep(0.2)
        assert not alive(stage), "the stage outlived its launcher"
    finally:
        if alive(stage):
            os.kill(stage, signal.SIGKILL)
