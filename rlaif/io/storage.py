"""Object storage through fsspec URLs: `file://` and `s3://`.

The S3 endpoint comes from config (`storage.endpoint_url`) or AWS_ENDPOINT_URL; credentials only from the environment.
"""
from __future__ import annotations

import contextlib
import glob as stdlib_glob
import hashlib
import importlib
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import fsspec

from rlaif.errors import UserError
from rlaif.io.urls import (  # noqa: F401 (storage's API: callers join and normalize through it)
    MALFORMED_SCHEME,
    browsable,
    check_no_variables,
    join,
    normalize,
)

_s3_options: dict = {}


def configure(endpoint_url: str | None) -> None:
    """Set the S3 endpoint for this process (config wins over AWS_ENDPOINT_URL) and how long a call may take."""
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    _s3_options.clear()
    _s3_options["config_kwargs"] = s3_call_limits()
    _no_expect_continue()
    if endpoint:
        _s3_options["client_kwargs"] = {"endpoint_url": endpoint}
        os.environ["AWS_ENDPOINT_URL"] = endpoint  # child processes (torchrun ranks) inherit it
    if "webdataset" in sys.modules:  # else rlaif.io.shards registers it on import: webdataset imports torch (~2 s)
        register_webdataset_s3()


def endpoint_url() -> str:
    """The S3 endpoint this process was configured with; "" for AWS's own."""
    return (_s3_options.get("client_kwargs") or {}).get("endpoint_url", "")


def s3_call_limits() -> dict:
    """botocore's retries for every S3 call. s3fs tries each call 5 times itself (5 s connects, 15 s reads), around
    botocore's legacy 5 attempts: an endpoint that accepts connections and never answers held a run silent for over
    6 minutes. Here 2 attempts in standard mode (AWS_MAX_ATTEMPTS and AWS_RETRY_MODE override them, as for any AWS
    client), so such an endpoint fails in about 2.5 minutes, while throttling (SlowDown) is still retried with
    backoff by both."""
    attempts = os.environ.get("AWS_MAX_ATTEMPTS") or "2"
    if not attempts.isdigit() or int(attempts) < 1:
        raise UserError(f"AWS_MAX_ATTEMPTS={attempts!r}: give a whole number of attempts, 1 or more")
    return {"retries": {"total_max_attempts": int(attempts), "mode": os.environ.get("AWS_RETRY_MODE") or "standard"}}


def _no_expect_continue() -> None:
    """PUTs without `Expect: 100-continue`: aiohttp waits for the 100 Continue with no timeout, so a put to an endpoint
    that accepts and never answers hung for good (timeouts and retries bound everything else). The body is then sent
    at once, which costs only a refused request's upload. Applies to botocore sessions created after this call."""
    try:
        from botocore import handlers
    except ImportError:
        return
    handlers.BUILTIN_HANDLERS[:] = [h for h in handlers.BUILTIN_HANDLERS if h[1] is not handlers.add_expect_header]


def failure_message(exc: BaseException) -> str | None:
    """An object-storage failure behind an exception (botocore's: endpoint unreachable or timing out, credentials,
    a refusal, a server error; not a missing object, which callers report themselves) as one line; None for
    anything else. A stage that meets one mid-run is not half-committed: the run resumes once storage answers."""
    errors = botocore_errors()
    seen = exc
    while seen is not None:
        code = str(((getattr(seen, "response", None) or {}).get("Error") or {}).get("Code", ""))
        if errors and isinstance(seen, errors) and code not in ("NoSuchKey", "404", "NoSuchUpload"):
            return (f"object storage failed ({first_line(seen)[:200]}): check storage.endpoint_url (or "
                    "AWS_ENDPOINT_URL), the credentials and the service, then run again (finished stages are kept)")
        seen = seen.__cause__ or seen.__context__
    return None


# An http(s) server that accepts a connection and never answers fails a request after 30 s without a byte (fsspec
# sends a HEAD, then a GET: about a minute in all). aiohttp's default bounds a whole request at 300 s instead, which
# both left such a server silent for ten minutes and would cut a large file's download on a slow link short: no
# bound on the whole transfer here, as long as bytes keep coming.
HTTP_TIMEOUTS_S = {"sock_connect": 10, "sock_read": 30}


def _options(url: str) -> dict:
    """fsspec's options for the URL's filesystem: object storage's endpoint and retry limits, http(s)'s timeouts."""
    if url.startswith("s3://"):
        return _s3_options
    if url.lower().startswith(("http://", "https://")):
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(**HTTP_TIMEOUTS_S)}}
    return {}


def filesystem(url: str):
    fs, _ = fsspec.core.url_to_fs(url, **_options(url))
    return fs


def _path(url: str) -> str:
    return fsspec.core.url_to_fs(url, **_options(url))[1]


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> Path:
    if url.startswith("file://localhost/"):  # RFC 8089's explicit local host, as normalize reads it
        return Path(url[len("file://localhost"):])
    return Path(url[len("file://"):] if url.startswith("file://") else url)


def exists(url: str) -> bool:
    return filesystem(url).exists(_path(url))


def bucket_missing(url: str) -> bool:
    """Does the endpoint say an s3:// URL's bucket is not there (404)? False for local paths, and where it cannot
    tell (a policy that grants a prefix only answers 403 for the bucket itself)."""
    if is_local(url):
        return False
    fs = filesystem(url)
    try:
        fs.call_s3("head_bucket", Bucket=url.split("://", 1)[1].split("/", 1)[0])
    except FileNotFoundError:  # s3fs's reading of 404 and NoSuchBucket
        return True
    except Exception:  # noqa: BLE001 (denied, throttled, unreachable: the caller's own line stands)
        return False
    return False


def open_url(url: str, mode: str = "rb"):
    if url.startswith("s3://"):  # no auto_mkdir: for s3fs a write's "parent directory" is a bucket it would create
        return fsspec.open(url, mode, auto_mkdir=False, **_s3_options).open()
    return fsspec.open(url, mode, **_options(url)).open()


def read_bytes(url: str) -> bytes:
    with open_url(url, "rb") as f:
        return f.read()


def read_text(url: str) -> str:
    return read_bytes(url).decode("utf-8")


def first_line(exc: BaseException) -> str:
    """An exception's message as one line for a user error: its first line, or its type where it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def botocore_errors() -> tuple[type[Exception], ...]:
    """botocore's base errors (no credentials, endpoint unreachable, a service's refusal), where it is installed."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return ()
    return BotoCoreError, ClientError


def is_dir(url: str) -> bool:
    """True for a local directory or an s3:// prefix that holds objects."""
    if is_local(url):
        return local_path(url).is_dir()
    try:
        return filesystem(url).isdir(_path(url))
    except OSError:  # no such bucket, endpoint down: reading it later reports why
        return False


def list_files(url: str) -> list[str]:
    """The files under a local directory or an s3:// prefix, as paths relative to it, sorted."""
    fs, root = filesystem(url), _path(url).rstrip("/")
    return sorted(name[len(root) + 1:] for name in fs.find(root) if name.startswith(root + "/"))


def rerun_hint(url: str) -> str:
    """The fix for a damaged file a stage committed: that stage run again past its cache."""
    from rlaif.graph import STAGE_BY_NAME

    stage = next((part for part in reversed(url.split("/")[:-1]) if part in STAGE_BY_NAME), None)
    if stage is None:
        return "re-run the stage that wrote it"
    return f"re-run stage '{stage}' (rlaif run --rerun {stage}, or rlaif launch {stage} --rerun)"


def sizes(url: str, names: list[str]) -> dict[str, int]:
    """The size in bytes of each of these files under a local directory or an s3:// prefix that exists (by its path
    relative to it): local files by a stat each, S3 by one fresh listing (not the filesystem's cached one)."""
    if is_local(url):
        found = {}
        for name in names:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                found[name] = (local_path(url) / name).stat().st_size
        return found
    fs, root = filesystem(url), _path(url).rstrip("/")
    fs.invalidate_cache(root)
    listed = {name[len(root) + 1:]: info for name, info in fs.find(root, detail=True).items()}
    return {name: int(listed[name].get("size") or 0) for name in names if name in listed}


def copy_to_local(url: str, relative_paths: list[str], dest: Path) -> None:
    """Copy these files under `url` (local or s3://) into `dest`, keeping their relative paths."""
    fs = filesystem(url)
    for rel in relative_paths:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(_path(join(url, rel)), str(target))


@contextlib.contextmanager
def named_on_failure(path: Path):
    """An OSError that names no file (a write or sendfile on a full disk) names `path`, the output it was for, so the
    one-line error says which disk ran out."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Readers never see a partial object: local files go through a temp file + rename; an S3 PUT is atomic."""
    if is_local(url):
        path = local_path(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with named_on_failure(path):
                tmp.write_bytes(data)
            os.replace(tmp, path)
        finally:  # a full disk or an interrupt leaves no partial temp file beside the output
            tmp.unlink(missing_ok=True)
    else:
        with open_url(url, "wb") as f:
            f.write(data)


def create_exclusive(url: str, data: bytes) -> bool:
    """Create the object only if nothing is there yet, atomically, with all of `data`: True if this call created it,
    False if it existed. Local files: a complete temp file hard-linked into place (link fails when the name exists;
    O_EXCL where the filesystem has no hard links); S3: a PUT with If-None-Match: * (412 when the key exists)."""
    if is_local(url):
        return _create_local(local_path(url), data)
    fs = filesystem(url)
    if "IfNoneMatch" not in _put_object_parameters():
        raise UserError("this botocore cannot send conditional writes (If-None-Match), which the stage lock needs: "
                        "upgrade s3fs/botocore (pip install -U s3fs)")
    bucket, _, key = _path(url).partition("/")
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
        return True
    except FileExistsError:  # s3fs's translation of 412 Precondition Failed
        return False
    except OSError as exc:
        code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
        if code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        raise


def _create_local(path: Path, data: bytes) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # no hard links here (some FUSE and SMB mounts): exclusive create, then write
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _put_object_parameters() -> set[str]:
    """The PutObject parameters the installed botocore knows (s3fs drops the others without a word)."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("s3")
    return set(model.operation_model("PutObject").input_shape.members)


def remove(url: str, recursive: bool = False) -> None:
    """Remove the object or directory if it is there (no existence check first: a listing cache could be stale)."""
    fs = filesystem(url)
    try:
        fs.rm(_path(url), recursive=recursive)
    except FileNotFoundError:
        pass


def glob(url_pattern: str) -> list[str]:
    """The URLs a pattern the user wrote matches (data.prompts may be one)."""
    fs = filesystem(url_pattern)
    scheme = "s3://" if url_pattern.startswith("s3://") else "file://"
    return sorted(scheme + p for p in fs.glob(_path(url_pattern)))


def glob_under(base_url: str, pattern: str) -> list[str]:
    """The URLs `pattern` matches under `base_url`, whose own name is taken literally: a root directory named
    `run*` or `exp[1]` matched `runA`'s or `exp1`'s files, which a stage then removed as its own."""
    scheme, path = base_url.split("://", 1)
    return glob(join(f"{scheme}://{stdlib_glob.escape(path)}", pattern))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def upload_file(local: Path, url: str) -> None:
    if is_local(url):
        dest = local_path(url)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        try:
            with named_on_failure(dest):
                shutil.copyfile(local, tmp)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    else:
        filesystem(url).put_file(str(local), _path(url))


def upload_dir(local_dir: Path, url: str) -> list[dict]:
    """Copy a local directory to `url`; returns [{path, bytes, sha256}] for the manifest."""
    entries = []
    for file in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
        rel = file.relative_to(local_dir).as_posix()
        if not (is_local(url) and local_path(url).resolve() == Path(local_dir).resolve()):
            upload_file(file, join(url, rel))
        entries.append({"path": rel, "bytes": file.stat().st_size, "sha256": sha256_file(file)})
    return entries


def cache_dir() -> Path:
    """$RLAIF_CACHE, or ~/.cache/rlaif where it is unset or empty (an empty one would be the working directory)."""
    return Path(os.environ.get("RLAIF_CACHE") or Path.home() / ".cache" / "rlaif").expanduser()


def download_dir(url: str, files: list[dict]) -> Path:
    """A local copy of a model directory listed in a manifest, verified by sha256 where the entry has one (local
    directories are verified in place)."""
    if is_local(url):
        target = local_path(url)
        for entry in files:
            if entry["sha256"] and sha256_file(target / entry["path"]) != entry["sha256"]:
                raise UserError(f"{join(url, entry['path'])} does not match its manifest checksum: "
                                + rerun_hint(join(url, entry["path"])))
        return target
    digest = hashlib.sha256((url + "".join(str(e["sha256"]) for e in files)).encode()).hexdigest()[:16]
    if any(e["sha256"] is None for e in files):
        digest += "-unverified"  # a plain directory: no manifest vouches for it, so its copy is refreshed per process
        shutil.rmtree(cache_dir() / "downloads" / digest, ignore_errors=True)
    target = cache_dir() / "downloads" / digest
    if (target / ".complete").exists():
        return target
    cache_dir().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
    try:
        copy_to_local(url, [entry["path"] for entry in files], tmp)
        for entry in files:
            if entry["sha256"] and sha256_file(tmp / entry["path"]) != entry["sha256"]:
                raise UserError(f"{join(url, entry['path'])} does not match its manifest checksum: "
                                + rerun_hint(join(url, entry["path"])))
        (tmp / ".complete").write_text("ok")
        target.parent.mkdir(parents=True, exist_ok=True)
    except BaseException:  # a damaged or interrupted copy: each retry would leave another whole model behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished the same download first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def register_webdataset_s3() -> None:
    """webdataset has no s3:// handler: open s3 URLs through s3fs (with our endpoint) in wds pipelines. Called when
    rlaif.io.shards is imported, and by configure() where webdataset already is."""
    schemes = importlib.import_module("webdataset.gopen").gopen_schemes

    def gopen_s3(url, mode="rb", bufsize=8192, **kw):
        return open_url(url, mode)

    schemes["s3"] = gopen_s3
