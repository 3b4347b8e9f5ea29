"""Which locomesh versions train together, and the one line that says when two cannot.

Every peer announces two versions: the locomesh package version (``LOCOMESH_VERSION``, e.g. 0.2.0,
for people) and the protocol version (``PROTOCOL_VERSION``, an integer, for the rule). The rule:
**peers with the same protocol version are compatible**, whatever their package versions (0.2.0 and
0.2.3 interoperate); any other pair is refused before it shares a round. The protocol version is
bumped whenever a message, record or round's meaning changes in a way an older peer would misread.
Protocol 1 is every locomesh before this check existed (their records carry no protocol field and
their streams open without the version hello).

The version hello and the record field travel over frames and stream ids that never change
(``/locomesh/<name>/1.0``, envelope 1.x), so any two versions can still tell each other why they part.

Tests fake another version in a real process with the environment variables
``LOCOMESH_FAKE_PROTOCOL_VERSION`` and ``LOCOMESH_FAKE_VERSION`` (read at each call, no CLI option).
"""

from __future__ import annotations

import logging
import os
import threading

from protocol.errors import printable

LOCOMESH_VERSION = "0.3.0"
PROTOCOL_VERSION = 3  # 3: relayed streams are authenticated end to end and sealed (protocol.circuit)
UPGRADE = "git pull && make setup"
OLD_VERSION = "before 0.2.0"  # what a peer without a version (protocol 1) is shown as

logger = logging.getLogger("locomesh.version")
_warned: dict[str, None] = {}  # ordered: the oldest are forgotten first, past MAX_WARNED (ids are free)
MAX_WARNED = 4096
_lock = threading.Lock()


def protocol_version() -> int:
    """This process's protocol version (``LOCOMESH_FAKE_PROTOCOL_VERSION`` overrides it, for tests)."""
    fake = os.environ.get("LOCOMESH_FAKE_PROTOCOL_VERSION", "")
    return int(fake) if fake.strip().lstrip("-").isdigit() else PROTOCOL_VERSION


def package_version() -> str:
    """This process's locomesh version (``LOCOMESH_FAKE_VERSION`` overrides it, for tests)."""
    return os.environ.get("LOCOMESH_FAKE_VERSION") or LOCOMESH_VERSION


def compatible(protocol: int) -> bool:
    """Whether a peer speaking ``protocol`` may train with this node: the same protocol version."""
    return protocol == protocol_version()


def incompatibility(peer: str, version: str, protocol: int) -> str | None:
    """The line that says why ``peer`` (locomesh ``version``, ``protocol``) cannot train with this
    node and what to do; None when it can."""
    if compatible(protocol):
        return None
    ours = protocol_version()
    advice = (f"upgrade that peer with `{UPGRADE}`" if protocol < ours
              else f"upgrade this node with `{UPGRADE}`")
    theirs = printable(version or "unknown", 40)
    return (f"peer {printable(peer, 60)} runs locomesh {theirs} (protocol {protocol}); this node runs {package_version()} "
            f"(protocol {ours}): not training with it, {advice}")


def note_incompatible(peer: str, version: str, protocol: int) -> str | None:
    """Like :func:`incompatibility`, and log the line as a warning the first time ``peer`` is seen
    incompatible in this process (records are read every heartbeat: one line per peer, not per read)."""
    line = incompatibility(peer, version, protocol)
    if line is not None:
        with _lock:
            first = peer not in _warned
            _warned[peer] = None
            while len(_warned) > MAX_WARNED:
                del _warned[next(iter(_warned))]
        if first:
            logger.warning("%s", line)
    return line
