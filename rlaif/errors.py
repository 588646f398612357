"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, malformed shard): one line naming it and the fix."""


def redact(text: str) -> str:
    """Text with the user and password of any URL in it masked (scheme://user:pass@host -> scheme://***@host)."""
    import re

    return re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@", r"\1***@", text)
