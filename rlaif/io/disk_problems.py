"""A failed write as a user can act on it: a full or read-only disk, a path this user may not use, a path of the
wrong kind, found behind whatever exception carries it (an OSError, or a library's error wrapping one)."""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

from rlaif.io import storage
from rlaif.scratch import machine_temp_dir

DISK_FULL = ("No space left on device", "Disk quota exceeded", "StorageFull")
READ_ONLY = ("Read-only file system", "ReadOnlyFilesystem")
WRITE_FAILED = ("PytorchStreamWriter failed writing file",)  # torch.save on a full disk says no more than this
ELSEWHERE = "storage.root, TMPDIR or RLAIF_CACHE"


WRONG_KIND = {errno.ENOTDIR: "part of this path is a file where a directory is expected",
              errno.EISDIR: "this is a directory where a file is expected",
              errno.EEXIST: "this exists and is not the directory expected here"}


def _wrong_kind_on_disk(error: OSError) -> str | None:
    """The error's path (a rename's destination first) where it is what its errno says: not a race, such as two
    ranks creating one directory."""
    for name in (error.filename2, error.filename):
        if not isinstance(name, str):
            continue
        path = Path(name)
        if ((error.errno == errno.ENOTDIR and any(part.is_file() for part in (path, *path.parents)))
                or (error.errno == errno.EISDIR and path.is_dir())
                or (error.errno == errno.EEXIST and path.exists() and not path.is_dir())):
            return name
    return None


def _object_storage_failure(exc: BaseException) -> bool:
    return storage.failure_message(exc) is not None


def disk_problem(exc: BaseException) -> str | None:
    """A full or read-only disk, a path this user may not use, or a path of the wrong kind (a file where the storage
    tree or cache holds a directory, or the reverse), behind an exception (an OSError, or a library's error wrapping
    one: safetensors, torch.save), as a one-line user error; None for anything else."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in WRONG_KIND and (where := _wrong_kind_on_disk(seen)):
            return (f"{where}: {WRONG_KIND[seen.errno]}: move it away, or point storage.root, --run-id or "
                    "RLAIF_CACHE elsewhere")
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            where = seen.filename2 or seen.filename
            if seen.errno == errno.EROFS:
                return f"cannot write{f' {where}' if where else ''}: {seen.strerror}: point it at a writable disk"
            room = f"point {ELSEWHERE} at a disk with room"
            if where:
                return f"cannot write {where}: {seen.strerror}: free space there, or {room}"
            return f"cannot write: {seen.strerror}{_room_left()}: free space, or {room}"
        if isinstance(seen, PermissionError) and not _object_storage_failure(exc):  # a local path this user may
            # not write, or not even search (s3fs raises PermissionError for S3's AccessDenied: its own message)
            where = seen.filename2 or seen.filename
            return (f"cannot use{f' {where}' if where else ''}: {seen.strerror}: give this user access to it, or "
                    f"point storage.root, the output path or RLAIF_CACHE elsewhere")
        text = str(seen).splitlines()[0][:200] if str(seen) else ""
        if any(marker in text for marker in DISK_FULL):
            return (f"a write failed for lack of disk space ({text}){_room_left()}: free space, or point {ELSEWHERE} "
                    "elsewhere")
        if any(marker in text for marker in WRITE_FAILED):
            return (f"a write failed ({text}), most likely for lack of disk space{_room_left()}: free space, or point "
                    f"{ELSEWHERE} elsewhere")
        if any(marker in text for marker in READ_ONLY):
            return f"a write failed on a read-only disk ({text}): point {ELSEWHERE} at a writable disk"
        seen = seen.__cause__ or seen.__context__
    return None


def _room_left() -> str:
    """The free space now where a stage writes locally, for a disk-full error that names no file (a library's
    serializer, a plain write): which of TMPDIR, the model cache and the working directory (the default storage
    root's) ran out. Places on one filesystem are named together."""
    filesystems: dict[int, tuple[list[str], int]] = {}
    for name, where in (("TMPDIR", lambda: Path(machine_temp_dir())), ("the model cache", storage.cache_dir),
                        ("the working directory", Path.cwd)):
        try:  # each can fail too (a removed working directory, no usable TMPDIR): that place is left out
            path = where()
            existing = next((place for place in (path, *path.parents) if place.exists()), Path("/"))
            device, free = existing.stat().st_dev, shutil.disk_usage(existing).free
        except OSError:
            continue
        filesystems.setdefault(device, ([], free))[0].append(f"{name} {path}")
    places = [f"{_listed(names)}: {_size(free)}" for names, free in filesystems.values()]
    return f"; free now: {'; '.join(places)}" if places else ""


def _size(free: int) -> str:
    return f"{free / 2**30:,.0f} GiB" if free >= 10 * 2**30 else f"{free / 2**20:,.0f} MiB"


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
