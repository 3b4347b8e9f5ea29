"""Why a fetch from a peer failed, as a metric label: the peer's fault, the network's, or ours.

A programming error (KeyError, TypeError, …) while fetching or decoding is this node's bug, not a
broken connection: it is counted as ``internal`` and logged at warning with its traceback, once per
kind and place, so a bug shows up instead of hiding among flaky links.
"""

from __future__ import annotations

import asyncio
import logging
import traceback

from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from compression import CodecError
from protocol.errors import GroupClosed, ProtocolError, RemoteError, TruncatedFrame

logger = logging.getLogger(__name__)
NETWORK_ERRORS = (ConnectionError, EOFError, TruncatedFrame, P2PDaemonError, P2PHandlerError, OSError)
_reported: set[tuple[str, str]] = set()
LATE = "late"  # the label of a fetch refused because the peer's rendezvous closed without this node


def failure_reason(error: BaseException, what: str) -> str:
    """The label of ``error`` (``timeout``, ``connection``, ``late``, a protocol code, ``schema`` or ``internal``);
    ``what`` names the failed action for the one traceback an internal error gets."""
    if isinstance(error, asyncio.TimeoutError):
        return "timeout"
    if isinstance(error, RemoteError) and error.remote_code == GroupClosed.code:
        return LATE  # the peer's group closed before this node registered (a claim: gossip.late_round weighs it)
    if isinstance(error, ProtocolError):
        return getattr(error, "code", "schema")
    if isinstance(error, CodecError):
        return "schema"
    if isinstance(error, NETWORK_ERRORS):
        return "connection"
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    if (type(error).__name__, where) not in _reported:
        _reported.add((type(error).__name__, where))
        logger.warning("internal error while %s (a bug in this node, not the peer's): %s: %s", what, type(error).__name__,
                       error, exc_info=(type(error), error, error.__traceback__))
    return "internal"
