"""Where commands write what the user names: the storage root, and the files a command writes where the user says
(compile's pipeline YAML, report's comparison, launch's manifest). Checked before any work, so a place that cannot
be written fails in one line instead of after the work; files written whole or not at all."""
from __future__ import annotations

import errno
import os
import re
import stat
import sys
import tempfile
import uuid
from pathlib import Path

from rlaif.errors import UserError
from rlaif.io.storage import (
    botocore_errors,
    endpoint_url,
    first_line,
    is_local,
    join,
    local_path,
    normalize,
    remove,
    write_bytes_atomic,
)


def check_writable(root: str) -> None:
    """Fail early, with one line, when the storage root cannot be written (an s3:// root's bucket must exist: it is
    never created). A local root is not created here: a run refused by a later check leaves nothing behind."""
    if is_local(root):
        _check_local_writable(local_path(root))
        return
    if (why := s3_write_problem(root)) is None:
        return
    if bucket := missing_bucket(root, why):
        raise UserError(f"storage root {root}: {no_such_bucket(bucket)}")
    raise UserError(f"storage root {root} is not writable ({why}): check the path's permissions, or for s3:// the "
                    "bucket, endpoint and AWS_* credentials")


def s3_write_problem(prefix: str) -> str | None:
    """Why no object can be written under this s3:// prefix (a probe object written and removed), or None."""
    probe = join(prefix, f".rlaif-probe-{uuid.uuid4().hex}")
    try:
        write_bytes_atomic(probe, b"ok")
        remove(probe)
    except Exception as exc:  # PermissionError, botocore errors, ...: all mean the same to a user
        return first_line(exc)
    return None


def missing_bucket(url: str, why: str) -> str | None:
    """The bucket of an s3:// URL where a failure's message says it does not exist (it is never created)."""
    if "NoSuchBucket" in why or "bucket does not exist" in why:
        return url.split("://", 1)[1].split("/", 1)[0]
    return None


def no_such_bucket(bucket: str) -> str:
    """What to say of a bucket the endpoint says is not there."""
    return f"bucket {bucket!r} does not exist{bucket_hints(bucket)}: create it, or fix the name"


def bucket_hints(bucket: str) -> str:
    """The likelier mistakes behind a missing bucket, where they show: an uppercase name (S3 names are lowercase),
    an endpoint URL with a path (taken for part of the bucket's address); "" where none does."""
    from urllib.parse import urlsplit

    endpoint = endpoint_url()
    hints = ([f"S3 bucket names are lowercase ({bucket.lower()!r}?)"] if bucket != bucket.lower() else []) + (
        [f"the endpoint {endpoint} has a path ({urlsplit(endpoint).path}): give scheme://host:port"]
        if urlsplit(endpoint).path.strip("/") else [])
    return f" ({'; '.join(hints)})" if hints else ""


def _check_local_writable(root: Path) -> None:
    """The root, or where it would be created (its nearest existing ancestor), is a directory this user can write."""
    existing = root.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"storage root {root} is not writable ({existing} is a file, not a directory): set "
                        "storage.root to a directory")
    try:
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission on {existing}")
        tempfile.TemporaryFile(dir=existing).close()  # what access() misses: a read-only mount, a full disk
    except OSError as exc:
        raise UserError(f"storage root {root} is not writable ({first_line(exc)}): check the path's permissions, "
                        "or set storage.root to another directory") from None



S3_ACCESS_FIX = "check the bucket, the endpoint (storage.endpoint_url or AWS_ENDPOINT_URL) and the AWS_* credentials"


STDOUT = "-"


def is_stream(url: str) -> bool:
    """`-` (standard output), a pipe or terminal (/dev/stdout, /dev/null), or a file reached through /dev/stdout
    (a shell redirect): written in place, where a file is replaced whole by a rename. Never a block device."""
    if url == STDOUT:
        return True
    if "://" in url and not url.startswith("file://"):
        return False
    path = _as_given(url)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    redirected = stat.S_ISREG(mode) and (path in ("/dev/stdout", "/dev/stderr")
                                         or re.fullmatch(r"/dev/fd/\d+|/proc/self/fd/\d+", path) is not None)
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or redirected


def _as_given(url: str) -> str:
    """A stream's local path as the user wrote it: normalising would resolve /dev/stdout to a pipe's pseudo-name."""
    return url.removeprefix("file://")


def check_output_file(value: str, flag: str, what: str, example: str, suffixes: tuple[str, ...] = (),
                      remote: bool = False) -> str:
    """A file the user names for a command to write when done (`flag`: --output, --manifest-out), checked before any
    work, so that a name it cannot write fails in one line instead of after the work: its suffix, no directory or
    device in its place, a parent that is an existing directory, and what the write takes tried without changing
    anything (a probe file created and removed beside it; an existing file opened for appending, never truncated).
    `-`, a pipe or a /dev file (is_stream) is taken as it is. `remote`: s3:// is written too (a probe object).
    Returns the URL to give write_output_file."""
    if is_stream(value):
        if value != STDOUT and not os.access(_as_given(value), os.W_OK):
            raise UserError(f"{flag} {value}: no permission to write it: name a file you can write, or -")
        return value
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
        raise UserError(f"{flag} {value}: {no_such_bucket(bucket)}" if bucket
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
    filled, permissions changed during the work) is one line as well. A stream is written in place."""
    try:
        if url == STDOUT:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        elif is_stream(url):
            # Appended: after what a shell redirect has written there already.
            with open(_as_given(url), "ab") as stream:
                stream.write(data)
        else:
            write_bytes_atomic(url, data)
    except (OSError, *botocore_errors()) as exc:
        if is_local(url) and isinstance(exc, OSError):
            raise UserError(f"{flag} {url}: {_write_problem(exc, local_path(url))}") from None
        raise UserError(f"{flag} {url} could not be written ({first_line(exc)[:200]}): {S3_ACCESS_FIX}") from None
