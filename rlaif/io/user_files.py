"""Files the user names (config, prompts, constitution, few-shot examples), local or s3://: read as text or JSON
(Lines) with every failure one UserError line that names the file and the fix."""
from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import unicodedata

from rlaif.errors import UserError, one_line
from rlaif.io.storage import (
    botocore_errors,
    first_line,
    is_local,
    local_path,
    read_bytes,
)
from rlaif.io.urls import MALFORMED_SCHEME, check_no_variables


@contextlib.contextmanager
def user_read_errors(url: str, what: str, fix: str, also: tuple[str, ...] = ()):
    """Reading (or listing, globbing, copying) what the user named fails in one line: a URL scheme not read here
    (`also`: more that the caller reads), missing, unreadable, or on s3:// no such bucket, endpoint unreachable,
    access denied, no credentials (s3fs raises OSError kinds for most of them; botocore's own errors, credentials
    and connections among them, come through as they are)."""
    check_no_variables(url)
    if "://" not in url and MALFORMED_SCHEME.match(url):
        raise UserError(f"{what} {url!r} looks like a URL without its '//': write file:///absolute/path, "
                        f"s3://bucket/key, or a plain path ({fix})")
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme not in also and (why := _unreadable_scheme(scheme)):
        raise UserError(f"{what} {url}: {scheme}:// cannot be read here ({why}): copy it to local disk, s3:// or "
                        f"an http(s) URL first ({fix})")
    try:
        yield
    except FileNotFoundError as exc:
        if (unreachable := _unreachable(exc)) is not None:
            raise UserError(f"{what} {url} cannot be read ({unreachable}): check the URL and that its server is up, "
                            "or copy the file to local disk or s3://") from None
        relative = "" if "://" in url or os.path.isabs(os.path.expanduser(url)) else \
            f"; a relative path is read from the working directory, {os.getcwd()}, not from the config's"
        raise UserError(f"{what} not found: {url} ({fix}{relative})") from None
    except (PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        inside = f" at {exc.filename}" if exc.filename and str(exc.filename) not in url else ""  # a run's file
        raise UserError(f"{what} {url} cannot be read ({type(exc).__name__}{inside}): {_fix_for(url, fix)}") from None
    except (OSError, *botocore_errors()) as exc:
        raise UserError(f"{what} {url} cannot be read ({first_line(exc)[:200]}): {_fix_for(url, fix)}") from None


def _unreachable(exc: BaseException) -> str | None:
    """Why a server behind a URL gave no file, where fsspec's http reports every failure as not found: no answer in
    time, no connection, or an HTTP error other than 404 (401, 403 for an expired signed URL, 5xx); None for 404 or
    anything else."""
    import asyncio

    seen = exc.__cause__ or exc.__context__
    while seen is not None:
        status = getattr(seen, "status", None)
        if isinstance(status, int) and type(seen).__name__ == "ClientResponseError":
            return None if status == 404 else f"the server answered {status} {getattr(seen, 'message', '')}".strip()
        if isinstance(seen, (TimeoutError, asyncio.TimeoutError)):  # the same class from Python 3.11 on
            return f"the server did not answer in time: {first_line(seen)[:160]}"
        if isinstance(seen, ConnectionError) or type(seen).__name__.startswith(("ClientConnector", "ServerDisconn")):
            return f"the server cannot be reached: {first_line(seen)[:160]}"
        seen = seen.__cause__ or seen.__context__
    return None


def _unreadable_scheme(scheme: str) -> str | None:
    """Why fsspec cannot read URLs of this scheme here (unknown, or its package missing: gs:// needs gcsfs), or None
    (file, s3, http and https always can)."""
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ValueError, ImportError) as exc:
        return one_line(exc, 120) or type(exc).__name__
    return None


def _fix_for(url: str, fix: str) -> str:
    """An s3:// object that exists but cannot be read is a matter of access, not of the file: say where to look."""
    if not url.startswith("s3://"):
        return fix
    return (f"check the AWS_* credentials, the endpoint (storage.endpoint_url or AWS_ENDPOINT_URL) and the bucket's "
            f"policy, or {fix}")


def read_user_bytes(url: str, what: str, fix: str) -> bytes:
    """A file the user names (config, prompts, constitution, few-shot), local or s3://, as bytes, or a one-line
    UserError: missing, not a regular file (a directory or a FIFO, which would block the read) or unreadable."""
    with user_read_errors(url, what, fix):
        if is_local(url):
            mode = os.stat(local_path(url)).st_mode
            if not stat.S_ISREG(mode):
                raise UserError(f"{what} {url} is not a regular file (a directory, FIFO or device): {fix}")
        return read_bytes(url)


def read_user_file(url: str, what: str, fix: str) -> str:
    """A file the user names, as UTF-8 text (read_user_bytes' errors, and one for text that is not UTF-8). A leading
    byte-order mark, which Windows editors write, is dropped: it would otherwise start the first key or prompt."""
    data = read_user_bytes(url, what, fix)
    if data[:2] == b"\x1f\x8b":
        raise UserError(f"{what} {url} is gzip-compressed: decompress it first (gunzip) and name the result")
    if b"\x00" in data:  # UTF-16 (with or without its byte-order mark) or a binary file: every other byte is NUL
        raise UserError(f"{what} {url} holds NUL bytes (UTF-16 text, or not a text file): re-encode it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {url} is not UTF-8 (byte {exc.start}): re-encode it as UTF-8") from None


def is_json_object(text: str | bytes) -> bool:
    """Whether `text` parses as one JSON object (a JSON Lines row, an API's JSON answer rather than a web page)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class DuplicateKey(ValueError):
    """A JSON object names this key twice (args[0])."""


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object_pairs_hook that refuses a key given twice in one object, in one pass over the keys."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def parse_json(text: str, where: str):
    """JSON, or a one-line UserError naming `where`: invalid, or an object with a key twice (json.loads would keep
    the last one silently, so a row with two "prompt"s would lose the first)."""
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except DuplicateKey as exc:
        raise UserError(f"{where} has the key {exc.args[0]!r} twice: keep one") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        reason = f" ({exc.msg}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else " (nested too deep)"
        raise UserError(f"{where} is not valid JSON{reason}") from None


def text_lines(text: str) -> list[str]:
    """A file's lines, split at line ends only (LF, CRLF, or a lone CR as old Mac editors write): str.splitlines also
    splits at U+2028, form feeds and other Unicode boundaries, which JSON strings and prompts may hold as text."""
    return re.split(r"\r\n|\r|\n", text)


def is_blank(text: str) -> bool:
    """Nothing a reader sees: spaces, and format characters such as zero-width spaces, joiners and marks."""
    return all(ch.isspace() or unicodedata.category(ch) in ("Cf", "Cc") for ch in text)


def parse_jsonl(text: str, where: str) -> list[tuple[int, object]]:
    """JSON Lines as (line number, value) for the non-blank lines; errors name `where` and the line."""
    return [(number, parse_json(line, f"{where} line {number}"))
            for number, line in enumerate(text_lines(text), 1) if line.strip()]


def read_user_jsonl(url: str, what: str, fix: str) -> list[tuple[int, object]]:
    """A JSONL file the user names (read_user_file's errors, then parse_jsonl's)."""
    return parse_jsonl(read_user_file(url, what, fix), f"{what} {url}")
