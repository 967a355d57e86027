"""The errors a user's mistake raises: the bottom of the import order, every package may import it.

:class:`ConfigError` is a configuration or input problem found by validation or by a
package's ``check(cfg)`` (a ``ValueError``, one line naming the key and what is accepted);
:class:`UsageError` is a command-line mistake. The launcher prints either in one line and
exits with status 2 before anything is written. This module imports nothing.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, reported as one line naming the key and what is accepted.

    The launcher catches it, prints ``str(err)`` and exits 2 before anything is written.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class UsageError(Exception):
    """A command-line or configuration mistake: reported in one line, exit status 2."""


class RunError(RuntimeError):
    """A run stopped on purpose by rljax's own rule about its data or inputs (the reward error
    bound, dynamic sampling's max_num_gen_batches): never a compiled program's fault, so a launch
    does not retry it with the compilation cache bypassed (:func:`rljax.compilation_cache.retry_bypassed`)."""
