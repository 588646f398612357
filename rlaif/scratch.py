"""Local scratch of a stage: what its processes write on the machine's own disk (shards before upload, checkpoints,
exports, metrics, torchrun's per-run directories) lives under one temporary directory that goes when the stage ends,
however its processes end. A launcher (`rlaif launch`, `rlaif run`, the DAGs' and KFP's steps) owns that directory
and hands it to the stage's processes as their TMPDIR, so a rank killed by a signal (kill -9, the OOM killer) leaves
nothing behind either (a launcher killed by a signal cannot remove its own: the next launcher on the machine does); a
stage process started by hand (`rlaif stage`) keeps a scratch of its own. Neither is where torch's kernel cache goes,
nor the directory a disk-full message names: that is the machine's temp directory."""
from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

# The temp directory the user gave (TMPDIR, or the system's), kept for the stage's processes whose own is a scratch.
MACHINE_TMPDIR = "RLAIF_MACHINE_TMPDIR"
OWNER = ".launcher.json"  # in a launcher's scratch: its host and pid, so a later launcher can tell it was orphaned
_outside: list[str] = []  # the machine's temp directory while this process's own is a scratch (in_process)


def machine_temp_dir() -> str:
    """The machine's temp directory, also inside a stage whose process temp directory is its scratch."""
    return os.environ.get(MACHINE_TMPDIR) or (_outside[-1] if _outside else tempfile.gettempdir())


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry and no $USER (OpenShift, a pod's run_as_user)
        return str(os.getuid())


def _inductor_cache(env) -> str:
    """torch.compile's kernel cache: where the environment says, else where torch puts it by default (under the
    machine's temp directory, not a scratch: it is worth keeping between stages)."""
    return env.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(machine_temp_dir(), f"torchinductor_{_user()}")


@contextlib.contextmanager
def for_processes(name: str, env: dict):
    """The launcher's side: the environment for a stage's processes, whose TMPDIR is a scratch directory removed
    once they have ended (the caller waits for them inside this block). Scratches that launchers killed by a signal
    left on this machine are removed first."""
    machine = env.get(MACHINE_TMPDIR) or machine_temp_dir()
    remove_orphans(machine)
    scratch = tempfile.mkdtemp(prefix=f"rlaif-{name}-", dir=machine)
    Path(scratch, OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    try:
        yield {**env, MACHINE_TMPDIR: machine, "TMPDIR": scratch, "TORCHINDUCTOR_CACHE_DIR": _inductor_cache(env)}
    finally:
        _remove(scratch)


def _remove(scratch: str) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
    if os.path.exists(scratch):  # a process killed with its launcher's stop may still be writing as it exits
        time.sleep(1.0)
        shutil.rmtree(scratch, ignore_errors=True)


def remove_orphans(machine: str) -> None:
    """Removes the scratch directories in `machine` whose launcher (on this host) is no longer running: one killed by
    a signal (kill -9, the OOM killer) could not remove its own. A directory of another host (a shared /tmp) or of a
    launcher still alive is left."""
    for owner_file in Path(machine).glob(f"rlaif-*/{OWNER}"):
        try:
            owner = json.loads(owner_file.read_text())
            if owner["host"] != socket.gethostname() or _alive(int(owner["pid"])):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        shutil.rmtree(owner_file.parent, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process
        return True
    return True


@contextlib.contextmanager
def in_process(name: str):
    """A stage process's scratch, as its process temp directory until the stage ends. Under a launcher that is the
    launcher's (no directory nested in it: paths stay short, Unix sockets under them included); by hand (`rlaif
    stage`) one of its own. Process-wide (tempfile's default directory), so not for stages run in threads."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _inductor_cache(os.environ)
    if os.environ.get(MACHINE_TMPDIR):
        yield
        return
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
