"""Deterministic fault injection for resilience tests: RLAIF_FAULT=<stage>:<step>:<rank> makes that rank SIGKILL
itself right after that step's checkpoint, as a pre-empted node would die. Unset, it does nothing."""
from __future__ import annotations

import os
import signal


def maybe_kill(stage: str, step: int, rank: int) -> None:
    spec = os.environ.get("RLAIF_FAULT")
    if not spec:
        return
    name, at_step, at_rank = spec.split(":")
    if name == stage and int(at_step) == step and int(at_rank) == rank:
        os.kill(os.getpid(), signal.SIGKILL)
