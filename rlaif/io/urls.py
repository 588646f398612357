"""Storage URLs as the user writes them, checked and made absolute: `file://`, plain paths and `s3://`. Strings
only: nothing here touches storage (rlaif.io.storage does)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from rlaif.errors import UserError

S3_KEY_BYTES = 1024  # the longest key S3 stores (KeyTooLongError past it)
RUN_KEY_BYTES = 256  # room for the longest key a run writes under its directory (checkpoints, TensorBoard files)

# "s3:/bucket", "s3:bucket": a known scheme without its "//", which would otherwise become a local directory.
MALFORMED_SCHEME = re.compile(r"(?i)(s3|s3a|s3n|file|gs|gcs|az|abfs|hf|https?):(?!//)")
VARIABLE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def check_no_variables(url: str) -> None:
    """A ${NAME}, or a $NAME of a variable that is set, in a path the user wrote (in a config, or quoted on a command
    line) is not expanded here: taken literally it would make a directory named `${HOME}`. ($ alone, as in an S3 key
    `team$ml`, is a character.)"""
    if match := next((m for m in VARIABLE.finditer(url) if m.group().startswith("${") or m.group(1) in os.environ),
                     None):
        raise UserError(f"path {url!r} holds {match.group()}, an environment variable, which is not expanded here: "
                        "write the path out")


def normalize(url: str) -> str:
    """Absolute URL: bare paths and relative file:// paths resolve against the working directory (~ expanded);
    file://localhost/path is /path."""
    check_no_variables(url)
    if "://" not in url:
        if MALFORMED_SCHEME.match(url):
            raise UserError(f"storage URL {url!r} looks like a URL without its '//': write s3://bucket/prefix, "
                            "file:///absolute/path, or a plain local path")
        return "file://" + str(Path(url).expanduser().resolve())
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()  # RFC 3986: S3:// is s3://
    if scheme == "file":
        if not rest:
            raise UserError(f"storage URL {url!r} has no path: write file:///absolute/path, file://relative/path or "
                            "a plain local path")
        if rest.startswith("localhost/"):  # RFC 8089's explicit local host (some tools write it): an absolute path
            rest = rest[len("localhost"):]
        return "file://" + str(Path(rest).expanduser().resolve())
    if scheme != "s3":
        raise UserError(f"storage URL {url!r}: only file:// and s3:// are supported")
    if any(part in ("", ".", "..") for part in rest.rstrip("/").split("/")[1:]):
        raise UserError(f"storage URL {url!r} has an empty, '.' or '..' part: S3 keeps keys literally (no "
                        "directories to resolve them against); write s3://bucket/prefix/...")
    _check_s3_url(url, rest)
    return "s3://" + rest.rstrip("/")


def _check_s3_url(url: str, rest: str) -> None:
    """What s3fs would read as something else: '?versionId=' made every path under a root one object (the first
    write replaced by the next, a stray object at the bucket's root); a host:port where the bucket goes."""
    if bad := sorted({ch for ch in rest if ch in "?#" or not ch.isprintable()}):
        raise UserError(f"storage URL {url!r} holds {', '.join(map(repr, bad))}, which object storage tools do not "
                        "keep as part of a key ('?' starts a query, '#' a fragment): use a prefix of letters, digits, "
                        "'-', '_', '.' and '/'")
    if wild := sorted(set(rest) & set("*[]")):  # s3fs expands them where a stage's outputs are removed
        raise UserError(f"storage URL {url!r} holds {', '.join(map(repr, wild))}, which storage tools read as a "
                        "wildcard (a re-run under s3://b/run* removed s3://b/runA's outputs): use a prefix of "
                        "letters, digits, '-', '_', '.' and '/'")
    bucket = rest.split("/", 1)[0]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{1,254}", bucket):
        hint = " (the endpoint goes in storage.endpoint_url)" if ":" in bucket else ""
        raise UserError(f"storage URL {url!r}: {bucket!r} is not a bucket name{hint}: write s3://bucket/prefix, "
                        "a bucket of 3-63 lowercase letters, digits, '-' and '.'")


def browsable(url: str) -> str:
    """A URL to paste into a browser: a file:// one percent-encoded (a space, '#' or '?' in the path cut it short)."""
    return Path(url[len("file://"):]).as_uri() if url.startswith("file://") else url


def join(url: str, *parts: str) -> str:
    scheme, separator, path = url.partition("://") if "://" in url else ("", "", url)
    # Only the path's trailing slashes go: file:/// (the filesystem root) joins to file:///part, not file:/part.
    return "/".join([scheme + separator + path.rstrip("/"), *[p.strip("/") for p in parts]])


def check_key_room(root: str, run_id: str) -> None:
    """An s3:// run directory whose keys would pass S3's limit: moto and MinIO take them, AWS refuses the first
    long one mid-stage (config.yaml was written, the stage failed at its first shard)."""
    if not root.startswith("s3://"):
        return
    prefix = join(root, run_id).split("/", 3)[3]
    if len(prefix.encode()) + RUN_KEY_BYTES > S3_KEY_BYTES:
        raise UserError(f"storage root and run id take {len(prefix.encode())} of S3's {S3_KEY_BYTES} bytes per key, "
                        f"leaving less than the {RUN_KEY_BYTES} a run's own keys need under them: use a prefix and run "
                        f"id of at most {S3_KEY_BYTES - RUN_KEY_BYTES} bytes together")
