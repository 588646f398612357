"""Local scratch of a stage: what its processes write on the machine's own disk (shards before upload, checkpoints,
exports, metrics, torchrun's per-run directories) lives under one temporary directory that goes when the stage ends,
however its processes end. A launcher (`rlaif launch`, `rlaif run`, the DAGs' and KFP's steps) owns that directory
and hands it to the stage's processes as their TMPDIR, so a rank killed by a signal (kill -9, the OOM killer) leaves
nothing behind either; a stage process started by hand (`rlaif stage`) keeps a scratch of its own. Neither is where
torch's kernel cache goes, nor the directory a disk-full message names: that is the machine's temp directory."""
from __future__ import annotations

import contextlib
import getpass
import os
import tempfile

# The temp directory the user gave (TMPDIR, or the system's), kept for the stage's processes whose own is a scratch.
MACHINE_TMPDIR = "RLAIF_MACHINE_TMPDIR"
_outside: list[str] = []  # the machine's temp directory while this process's own is a scratch (in_process)


def machine_temp_dir() -> str:
    """The machine's temp directory, also inside a stage whose process temp directory is its scratch."""
    return os.environ.get(MACHINE_TMPDIR) or (_outside[-1] if _outside else tempfile.gettempdir())


def _inductor_cache(env) -> str:
    """torch.compile's kernel cache: where the environment says, else where torch puts it by default (under the
    machine's temp directory, not a scratch: it is worth keeping between stages)."""
    return env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(machine_temp_dir(), f"torchinductor_{getpass.getuser()}")


@contextlib.contextmanager
def for_processes(name: str, env: dict):
    """The launcher's side: the environment for a stage's processes, whose TMPDIR is a scratch directory removed
    once they have ended (the caller waits for them inside this block)."""
    machine = machine_temp_dir()
    with tempfile.TemporaryDirectory(prefix=f"rlaif-{name}-", dir=machine, ignore_cleanup_errors=True) as scratch:
        yield {**env, MACHINE_TMPDIR: env.get(MACHINE_TMPDIR) or machine, "TMPDIR": scratch,
               "TORCHINDUCTOR_CACHE_DIR": _inductor_cache(env)}


@contextlib.contextmanager
def in_process(name: str):
    """A stage process's scratch, as its process temp directory until the stage ends. Process-wide (tempfile's
    default directory), so for `rlaif stage`, whose process runs one stage, not for stages run in threads."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache(os.environ)
    _outside.append(machine_temp_dir())
    try:
        with tempfile.TemporaryDirectory(prefix=f"rlaif-{name}-", ignore_cleanup_errors=True) as scratch:
            previous, tempfile.tempdir = tempfile.tempdir, scratch
            try:
                yield
            finally:
                tempfile.tempdir = previous
    finally:
        _outside.pop()
