"""`python -m rlaif.orchestration.parent_guard PROGRAM ARG...` runs PROGRAM in this process (exec) so that it gets
SIGTERM when the process that started it dies, however that one dies (kill -9, the OOM killer). Without it a torchrun
agent, or a stage's `rlaif launch` started by `rlaif run`, outlives its launcher and keeps writing the stage, while a
retry that finds the launcher gone takes the stage's lock and writes it too. Linux only."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
LAUNCHER_PID = "RLAIF_LAUNCHER_PID"  # set by the launcher in the environment of the stage it starts
STOP_GRACE_S = 20.0  # SIGTERM, then SIGKILL after this: inside a pod's default 30 s termination grace


def guarded(argv: list[str]) -> list[str]:
    """argv, run under this guard (Linux; elsewhere argv itself). The launcher's pid goes along: read in the child,
    the parent could already be gone and pid 1 look like it."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-m", "rlaif.orchestration.parent_guard", str(os.getpid()), *argv]


def main(launcher: int, argv: list[str]) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # kept across exec
    if os.getppid() != launcher:  # the launcher died before the call: nothing would signal us
        sys.exit(1)
    os.execv(argv[0], argv)


def kill_when_orphaned(grace_s: float = STOP_GRACE_S) -> None:
    """In a stage process the launcher started itself (one process, no torchrun agent between them): the guard gives
    it SIGTERM when the launcher dies, which it unwinds; this adds SIGKILL grace_s later for a stage that does not
    (stuck in a C call), as torchrun's agent does for its ranks. Nothing for torchrun's ranks, whose parent is the agent
    (they die with it: rlaif.distributed.die_with_parent), nor for a stage run by hand."""
    parent = os.getppid()
    if sys.platform.startswith("linux") and os.environ.get(LAUNCHER_PID) == str(parent):
        threading.Thread(target=_kill_after_parent, args=(parent, grace_s), daemon=True, name="orphan-watch").start()


def _kill_after_parent(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
