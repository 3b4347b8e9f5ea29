"""The one exception type for mistakes in a user's input or environment.

``node`` prints a :class:`UserError` as a single ``error: …`` line (what is wrong, with which flag or
file, and what to do) and exits with status 2; a traceback is shown only with ``--log-level debug``.
"""

from __future__ import annotations


class UserError(Exception):
    """A bad flag, file, port, device or folder: the message names it and says what to do."""


class JoinRefused(Exception):
    """Every peer of the run refused this node's credentials, or the run trains with other settings."""


class NotStarted(Exception):
    """The node could not start training: --min-peers did not come within --join-timeout, or the run's
    peers have stopped. The message says which and what to do."""
