"""Errors a user can cause, kept apart from bugs.

Every mistake a user can make (a bad config key, a mesh that does not fit the
devices, a missing data path, a foreign checkpoint) raises ``ConfigError`` with a
one-line message naming the bad value and what would be valid. The CLI turns it
into that line on stderr and exit status 2; anything else is a bug and keeps its
traceback.
"""


class ConfigError(ValueError):
    """A user mistake: the message is one line naming the value and what is valid."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
