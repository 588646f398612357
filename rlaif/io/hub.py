"""Models named by Hugging Face Hub id (`org/name`, `org/name@revision`, or `hf://org/name`): fetched into the Hugging
Face cache where a hub is reachable, read from that cache when the environment asks for offline mode
(HF_HUB_OFFLINE=1, which `make demo` and `make test` set; the images leave it to the deployer). A local directory of
the same name wins."""
from __future__ import annotations

import os
import re
from pathlib import Path

from rlaif.errors import UserError

HUB_ID = re.compile(r"(?:hf://)?([A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96})(?:@([\w./-]{1,128}))?")
# hf:// also takes the hub's legacy one-part ids (gpt2, distilgpt2); written bare, such a name is a local directory.
HF_URL = re.compile(r"hf://([A-Za-z0-9][\w.-]{0,95}(?:/[\w.-]{1,96})?)(?:@([\w./-]{1,128}))?")
# Only what loading needs: configs, safetensors weights, tokenizer files, and model code (which runs only with
# trust_remote_code); never pickled weights.
ALLOW = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def parse(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `spec` names a hub model rather than a local directory or another URL."""
    if spec.startswith("hf://"):
        match = HF_URL.fullmatch(spec)
        if not match:
            raise UserError(f"model {spec}: a hub model is hf://org/name or hf://name, each with an optional "
                            "@revision")
        return match.group(1), match.group(2)
    if "://" in spec or spec.startswith(("builtin:", "/", ".", "~")) or Path(spec).expanduser().exists():
        return None
    match = HUB_ID.fullmatch(spec)
    return (match.group(1), match.group(2)) if match else None


def _errors():
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    return (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
            *_network_errors(), OSError)


def _network_errors() -> tuple[type[Exception], ...]:
    """A hub that cannot be reached: no DNS, refused, timed out (huggingface_hub's HTTP client raises its own
    transport errors; sockets raise these OSErrors). Other OSErrors (a full disk, an unwritable HF_HOME) are not."""
    import importlib
    import socket

    found: list[type[Exception]] = [ConnectionError, TimeoutError, socket.gaierror]
    for client in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(client).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def _one_line(spec: str, what: str, exc: Exception) -> UserError:
    """The hub's many exceptions as the one line a user can act on."""
    http, invalid, not_cached, no_repo, no_revision, *_ = _errors()
    if isinstance(exc, not_cached):
        mode = ("the hub is off (HF_HUB_OFFLINE=1) and it is not in the Hugging Face cache" if offline()
                else "the hub could not be reached and it is not in the Hugging Face cache")
        return UserError(f"{what} {spec}: {_local_hint(spec)}{mode}: unset HF_HUB_OFFLINE on a machine with hub "
                         "access, or give a local directory or an s3:// URL")
    if isinstance(exc, no_revision):
        return UserError(f"{what} {spec}: no such revision on the hub")
    if isinstance(exc, no_repo):
        return UserError(f"{what} {spec}: {_local_hint(spec)}no such model on the hub (or it is gated: set HF_TOKEN)")
    if isinstance(exc, _network_errors()) and not isinstance(exc, (http, invalid)):
        return UserError(f"{what} {spec}: {_local_hint(spec)}the hub could not be reached "
                         f"({str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}): give a local "
                         "directory or an s3:// URL, or set HF_HUB_OFFLINE=1 where it is in the Hugging Face cache")
    if isinstance(exc, invalid):
        return UserError(f"{what} {spec}: not a valid hub model id ({str(exc).splitlines()[0][:120]})")
    if not isinstance(exc, http):  # a local failure while fetching: disk full, HF_HOME not writable
        return UserError(f"{what} {spec}: the Hugging Face cache could not be written ({exc}): check HF_HOME")
    return UserError(f"{what} {spec}: the hub answered {str(exc).splitlines()[0][:160]}")


def _local_hint(spec: str) -> str:
    """A hub-shaped name without hf:// may be a mistyped local path (most likely where its first part is a local
    directory): say it is not one."""
    if spec.startswith("hf://"):
        return ""
    first = spec.split("/", 1)[0]
    return f"no local directory {spec}{f' (./{first}/ exists)' if Path(first).is_dir() else ''}, and "


def snapshot(spec: str, what: str) -> Path:
    """The local snapshot directory of a hub model: downloaded once into the Hugging Face cache (HF_HOME), or found
    there in offline mode. Only the stage that loads the model calls this."""
    from huggingface_hub import snapshot_download

    repo_id, revision = parse(spec)
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW, local_files_only=offline()))
    except _errors() as exc:
        raise _one_line(spec, what, exc) from None


def commit(spec: str, what: str) -> str:
    """The commit a hub model resolves to, without downloading it: asked of the hub, or read from the cache offline.
    A launch checks every hub model this way before any work; the cache key holds the commit."""
    from huggingface_hub import HfApi

    if offline():
        return snapshot(spec, what).name
    repo_id, revision = parse(spec)
    try:
        return HfApi().model_info(repo_id, revision=revision).sha
    except _errors() as exc:
        raise _one_line(spec, what, exc) from None


def revision_digest(spec: str) -> str:
    """What a hub model enters a cache key as: its resolved commit."""
    repo_id, revision = parse(spec)
    try:
        return f"hub:{repo_id}@{commit(spec, 'model')}"
    except UserError:
        return f"hub:{repo_id}@{revision or 'main'}:unresolved"
