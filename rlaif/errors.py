"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""
import signal


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, malformed shard): one line naming it and the fix."""


class StageFailed(Exception):
    """A stage's process (or multi-node job) ended with a non-zero exit code; its own output names the cause."""

    def __init__(self, stage: str, code: int, message: str | None = None):
        super().__init__(message or f"stage '{stage}' {ending(code)}")  # message: its launcher's line, if it said
        self.code = code


# Exit codes of a process that stopped itself on a signal (rlaif's own processes do: 128 + the signal's number)
STOPPED = {130: "SIGINT (Ctrl-C)", 143: "SIGTERM (a pod deleted or evicted, `kill`, an orchestrator stopping it)"}


def ending(code: int) -> str:
    """How a process ended, from subprocess's returncode: negative is the signal that killed it."""
    if code in STOPPED:
        return f"was stopped by {STOPPED[code]} (its output is above)"
    if code >= 0:
        return f"failed with exit code {code} (its output is above)"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    # SIGKILL: `kill -9`, a node pre-empted or drained, or the kernel's out-of-memory killer (`dmesg`, or the pod's
    # status: OOMKilled, says which)
    cause = "a kill -9, a pre-empted node or the out-of-memory killer; " if name == "SIGKILL" else ""
    return f"was killed by {name} ({cause}its output is above)"


class Terminated(BaseException):
    """SIGTERM (a pod deleted, `kill`, Airflow stopping a task), unwound as Ctrl-C is: a launcher stops its stage's
    processes (or its multi-node job) and releases its lock before it exits, instead of dying at once and leaving
    them running."""


SECRET_WORDS = {"SECRET", "TOKEN", "PASSWORD", "PASSWD"}  # whole words of a variable's name
SECRET_PAIRS = ("API_KEY", "ACCESS_KEY")
NOT_SECRET = ("_FILE", "_PATH", "_URI", "_URL", "_DIR")  # where a credential is, not the credential
SHORTEST_SECRET = 8  # shorter values (a test's "x") would mask ordinary words in every message
_kept_secrets: set[str] = set()


def looks_secret(name: str) -> bool:
    """Does an environment variable's name say it holds a credential (AWS_SECRET_ACCESS_KEY, HF_TOKEN, *_API_KEY)?"""
    upper = name.upper()
    if upper.endswith(NOT_SECRET) or "DISABLE" in upper:  # HF_TOKEN_PATH, HF_HUB_DISABLE_IMPLICIT_TOKEN
        return False
    return bool(SECRET_WORDS & set(upper.split("_"))) or any(pair in upper for pair in SECRET_PAIRS)


def keep_secret(value: str | None) -> None:
    """A credential this process sends (an API key read from a variable of any name): never shown in an error line,
    even where a server echoes it back."""
    if value and len(value) >= SHORTEST_SECRET:
        _kept_secrets.add(value)


def one_line(reason: object, limit: int | None = 300) -> str:
    """A library's message (an exception, a server's answer) fit to sit inside one error line: its whitespace and
    line breaks as single spaces, at most `limit` characters (None: all of them)."""
    return " ".join(str(reason).split())[:limit]


def redact(text: str) -> str:
    """Text fit for an error line: in any URL the user and password and every query or fragment value masked
    (scheme://user:pass@host/p?token=t -> scheme://***@host/p?token=***), and the value of every credential in the
    environment (looks_secret) or sent by this process (keep_secret) masked wherever it appears."""
    import os
    import re

    text = re.sub(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+", lambda url: _masked_url(url.group(0)), text)
    secrets = _kept_secrets | {value for name, value in os.environ.items()
                               if len(value) >= SHORTEST_SECRET and looks_secret(name)}
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _masked_url(url: str) -> str:
    import re

    url = re.sub(r"^([^:]+://)[^/@]+@", r"\1***@", url)
    address, mark, rest = url.partition("?") if "?" in url else url.partition("#")
    return address + mark + re.sub(r"=[^&#;)\]}]*", "=***", rest) if mark else url
