"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, malformed shard): one line naming it and the fix."""


class StageFailed(Exception):
    """A stage's process (or multi-node job) ended with a non-zero exit code; its own output names the cause."""

    def __init__(self, stage: str, code: int):
        super().__init__(f"stage '{stage}' failed with exit code {code} (its output is above)")
        self.code = code


class Terminated(BaseException):
    """SIGTERM (a pod deleted, `kill`, Airflow stopping a task), unwound as Ctrl-C is: a launcher stops its stage's
    processes (or its multi-node job) and releases its lock before it exits, instead of dying at once and leaving
    them running."""


def redact(text: str) -> str:
    """Text with the user and password of any URL in it masked (scheme://user:pass@host -> scheme://***@host)."""
    import re

    return re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@", r"\1***@", text)
