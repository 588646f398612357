"""Stage manifests: the commit marker of a stage output.

`manifest.json` is written last and atomically. A stage output without a manifest does not exist. Its digest (over
the content fields, not timestamps) is what downstream stages key their caches on.
"""
from __future__ import annotations

import json
import math
import re
import time

from rlaif import __version__
from rlaif.config import sha256_json
from rlaif.errors import UserError
from rlaif.io import storage
from rlaif.io.digest import code_digest

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_DIGEST_FIELDS = ("schema_version", "stage", "config_hash", "inputs", "shards", "files", "num_samples")
# Files that record how a run went rather than what it made: per-step logs with throughput, TensorBoard event files
# (wall times in their names and records), the trackers' run ids and model cards (which name the run). Listed and
# size-checked like any file, but outside the digest: an unchanged re-run keeps its digest, so the stages below it
# stay cached.
RECORDS = re.compile(r"(?:^|/)(?:README\.md|metrics\.jsonl)$|^tensorboard/|^tracking\.json$")


def digest(manifest: dict) -> str:
    fields = {k: manifest.get(k) for k in _DIGEST_FIELDS}
    fields["files"] = [entry for entry in fields["files"] or []
                       if not (isinstance(entry, dict) and RECORDS.search(str(entry.get("path"))))]
    return sha256_json(fields)


def read(stage_url: str) -> dict | None:
    url = storage.join(stage_url, MANIFEST)
    try:
        data = storage.read_bytes(url)
    except FileNotFoundError:
        return None
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"{url} is not valid JSON: delete it and re-run the stage") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{url} is not a manifest (a JSON object): delete it and re-run the stage")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise UserError(f"{url} has schema version {manifest.get('schema_version')}, expected {SCHEMA_VERSION}: "
                        "re-run the stage")
    _check_shape(manifest, url)
    return manifest


def _inside(relative) -> bool:
    """A shard or file named relative to its stage directory and staying inside it (no scheme, root or '..')."""
    return (isinstance(relative, str) and relative != "" and "://" not in relative
            and not relative.startswith(("/", "\\")) and ".." not in relative.replace("\\", "/").split("/"))


def _check_shape(manifest: dict, url: str) -> None:
    """Fields a reader relies on; every shard and file it lists resolves under the manifest's own stage directory."""
    fields = {"stage": str, "config_hash": str, "inputs": dict, "shards": list, "files": list, "num_samples": int,
              "summary": dict, "digest": str}
    missing = [k for k, kind in fields.items() if not isinstance(manifest.get(k), kind)]
    if missing:
        raise UserError(f"{url} is missing or has malformed fields ({', '.join(missing)}): "
                        "delete it and re-run the stage")
    for shard in manifest["shards"]:
        if not (isinstance(shard, dict) and _inside(shard.get("url")) and isinstance(shard.get("count"), int)
                and isinstance(shard.get("sha256"), str)):
            raise UserError(f"{url} lists a shard outside its stage directory or without url/count/sha256: "
                            f"{str(shard)[:80]}")
    for entry in manifest["files"]:
        if not (isinstance(entry, dict) and _inside(entry.get("path"))):
            raise UserError(f"{url} lists a file outside its stage directory: {str(entry)[:80]}")


def damage(stage_url: str, manifest: dict) -> str | None:
    """What is wrong with a committed output's files, or None: every shard and file it lists present, at its recorded
    size (storage.sizes: a stat per file locally, one listing on S3; content is checked by sha256 where it is read).
    A cache hit on a deleted or truncated file would hand the stages downstream an error no re-run fixes."""
    listed = [(shard["url"], shard.get("bytes")) for shard in manifest["shards"]]
    listed += [(entry["path"], entry.get("bytes")) for entry in manifest["files"]]
    present = storage.sizes(stage_url, [name for name, _ in listed])
    for name, size in listed:
        if name not in present:
            return f"{name} is missing"
        if isinstance(size, int) and present[name] != size:
            return f"{name} has {present[name]} bytes where its manifest says {size}"
    return None


class MissingInput(UserError):
    """A stage's input has no committed manifest."""


def require(stage_url: str, stage: str) -> dict:
    manifest = read(stage_url)
    if manifest is None:
        raise MissingInput(f"input of stage missing: {storage.join(stage_url, MANIFEST)} does not exist; "
                        f"run stage '{stage}' first")
    return manifest


def invalidate(stage_url: str) -> None:
    """Start of a stage run: the old output stops existing before anything new is written."""
    storage.remove(storage.join(stage_url, MANIFEST))
    for shard in storage.glob_under(stage_url, "shard-*.tar"):
        storage.remove(shard)


def write(
    stage_url: str,
    *,
    stage: str,
    run_id: str,
    config_hash: str,
    inputs: dict[str, str],
    shards: list[dict] | None = None,
    files: list[dict] | None = None,
    num_samples: int | None = None,
    summary: dict | None = None,
    seconds: float | None = None,
    input_config_hashes: dict[str, str] | None = None,
) -> dict:
    shards = shards or []
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "stage": stage,
        "run_id": run_id,
        "config_hash": config_hash,
        "inputs": inputs,
        "shards": shards,
        "files": files or [],
        "num_samples": num_samples if num_samples is not None else sum(s["count"] for s in shards),
        "code_version": __version__,
        "code_digest": code_digest(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": seconds,  # the stage process's start to this commit (None: not timed)
        "summary": summary or {},
        # the cache keys of the upstream outputs it read (their digests, in `inputs`, are what the key covers): a
        # streaming reader tells from them whether the upstream running now makes the output it read before
        "input_config_hashes": input_config_hashes or {},
    }
    manifest = finite(manifest)
    manifest["digest"] = digest(manifest)
    storage.write_bytes_atomic(storage.join(stage_url, MANIFEST), to_json(manifest))
    return manifest


def finite(value):
    """`value` with NaN and infinities as None (null): JSON has no such numbers, and Python's bare NaN, which its own
    parser reads, is refused by strict ones (jq, JavaScript, Go)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def json_line(obj) -> str:
    """One JSONL line (metrics.jsonl, examples.jsonl), non-finite numbers as null, without its newline."""
    return json.dumps(finite(obj), allow_nan=False)


def to_json(obj) -> bytes:
    """A stage's JSON file (manifest, metrics, summaries): indented, non-finite numbers as null."""
    return json.dumps(finite(obj), indent=2, allow_nan=False).encode()
