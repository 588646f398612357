"""`python -m rlaif.orchestration.parent_guard PROGRAM ARG...` runs PROGRAM in this process (exec) so that it gets
SIGTERM when the process that started it dies, however that one dies (kill -9, the OOM killer). Without it a torchrun
agent, or a stage's `rlaif launch` started by `rlaif run`, outlives its launcher and keeps writing the stage, while a
retry that finds the launcher gone takes the stage's lock and writes it too. Linux only."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


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


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
