"""Errors a user can cause. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """A problem the user can fix (bad config, missing file, malformed shard): one line naming it and the fix."""
