"""Files a command writes where the user says (compile's pipeline YAML, report's comparison, launch's manifest):
checked before any work, so a name that cannot be written fails in one line instead of after the work, and written
whole or not at all."""
from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from rlaif.errors import UserError
from rlaif.io.storage import (
    botocore_errors,
    first_line,
    is_local,
    local_path,
    missing_bucket,
    normalize,
    s3_write_problem,
    write_bytes_atomic,
)

S3_ACCESS_FIX = "check the bucket, the endpoint (storage.endpoint_url or AWS_ENDPOINT_URL) and the AWS_* credentials"


def check_output_file(value: str, flag: str, what: str, example: str, suffixes: tuple[str, ...] = (),
                      remote: bool = False) -> str:
    """A file the user names for a command to write when done (`flag`: --output, --manifest-out), checked before any
    work, so that a name it cannot write fails in one line instead of after the work: its suffix, no directory or
    device in its place, a parent that is an existing directory, and what the write takes tried without changing
    anything (a probe file created and removed beside it; an existing file opened for appending, never truncated).
    `remote`: s3:// is written too (a probe object). Returns the URL to give write_output_file."""
    try:
        url = normalize(value)
    except UserError as exc:
        raise UserError(f"{flag}: {exc}") from None
    if suffixes and not url.endswith(suffixes):
        raise UserError(f"{flag} {value}: name {what} to write, e.g. {example}")
    if is_local(url):
        _check_local_output(local_path(url), f"{flag} {value}", what, example)
    elif not remote:
        raise UserError(f"{flag} {value}: name a local file, e.g. {example}")
    elif (why := s3_write_problem(url.rsplit("/", 1)[0])) is not None:
        bucket = missing_bucket(url, why)
        raise UserError(f"{flag} {value}: bucket {bucket!r} does not exist: create it, or fix the name" if bucket
                        else f"{flag} {value} cannot be written ({why[:200]}): {S3_ACCESS_FIX}")
    return url


def _check_local_output(path: Path, label: str, what: str, example: str) -> None:
    if path.is_dir():
        raise UserError(f"{label} is a directory: name {what} to write, e.g. {path / example}")
    if path.exists() and not path.is_file():  # a rename would replace the device or FIFO itself
        raise UserError(f"{label} is not a regular file (a device, FIFO or socket): name {what} to write, e.g. "
                        f"{example}")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{label}: {existing} is a file, not a directory: name {what} in a directory that "
                        "exists")
    if existing != path.parent:
        raise UserError(f"{label}: directory {path.parent} does not exist: create it first")
    if (error := _local_write_error(path)) is not None:
        raise UserError(f"{label}: {_write_problem(error, path)}")


def _local_write_error(path: Path) -> OSError | None:
    """What writing `path` as write_bytes_atomic does would fail with, tried without changing anything."""
    probe = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # where the write's temp file goes
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        probe.unlink()
        if path.exists():
            with open(path, "ab"):  # appending truncates nothing: the old file stays until the new one is whole
                pass
    except OSError as exc:
        return exc
    return None


def _write_problem(error: OSError, path: Path) -> str:
    """An output file's write failure as `problem: fix`."""
    if error.errno in (errno.EACCES, errno.EPERM):
        if str(error.filename) == str(path):  # an existing read-only file
            return f"no permission to write it ({error.strerror}): make it writable, or name another file"
        return f"no permission to write in {path.parent} ({error.strerror}): name a file in a directory you can write"
    if error.errno == errno.EROFS:
        return f"{path.parent} is on a read-only filesystem: name a file on a writable disk"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on the disk of {path.parent} ({error.strerror}): free space, or name another disk"
    return f"cannot write files in {path.parent} ({error.strerror or error}): name a file in a directory you can write"


def write_output_file(url: str, data: bytes, flag: str) -> None:
    """Write a file check_output_file passed, whole or not at all (write_bytes_atomic); a failure now (a disk that
    filled, permissions changed during the work) is one line as well."""
    try:
        write_bytes_atomic(url, data)
    except (OSError, *botocore_errors()) as exc:
        if is_local(url) and isinstance(exc, OSError):
            raise UserError(f"{flag} {url}: {_write_problem(exc, local_path(url))}") from None
        raise UserError(f"{flag} {url} could not be written ({first_line(exc)[:200]}): {S3_ACCESS_FIX}") from None
