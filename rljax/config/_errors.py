"""The configuration error type."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key and what is accepted.

    The launcher catches it, prints ``str(err)`` and exits 2 before anything is written.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
