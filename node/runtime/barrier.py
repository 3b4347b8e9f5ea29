"""The start-up barrier (``--min-peers``), and what a node reads from the run's records before its
first step: which peers train, which have left, which run another protocol version.

A node waits until ``--min-peers`` trainers (itself included) are in the run, so a fast first node
does not train alone for rounds while the others start. A run that already trains (a peer is into a
round: its inner step is past 0) is joined at once. The wait lasts at most ``--join-timeout``; then the
node exits with one line (it does not start alone: that is what the barrier prevents). A run whose
peers have all stopped (their records say they left, or went away) is reported as such at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from gossip.rendezvous import list_peers_with_expiry
from node.errors import JoinRefused, NotStarted
from node.runtime.network import Interrupted, NetworkThread
from protocol.records import PeerRecord
from protocol.version import compatible, note_incompatible, protocol_version

logger = logging.getLogger("locomesh.node")
LOG_EVERY_S = 10.0
GONE_S = 10.0  # a trainer whose record has been missing this long went away (records live 8 s unrefreshed)


def short(peer: str) -> str:
    return "…" + peer[-8:]


@dataclass
class Census:
    """The run's records other than this node's, sorted by what they say."""

    trainers: dict[str, PeerRecord] = field(default_factory=dict)  # live trainers of this protocol version
    leaving: list[str] = field(default_factory=list)  # announced that they stopped
    incompatible: dict[str, PeerRecord] = field(default_factory=dict)  # another protocol version

    @property
    def training(self) -> bool:
        """Whether the run already trains: a peer is into a round."""
        return any(rec.inner_step > 0 for rec in self.trainers.values())


def census(net: NetworkThread, run_id: str, me: str) -> Census:
    """Read the run's records (one DHT read)."""
    assert net.dht is not None
    records = net.call(list_peers_with_expiry(net.dht, run_id, compatible_only=False), timeout=30)
    out = Census()
    for peer, (rec, _) in sorted(records.items()):
        if peer == me:
            continue
        if not compatible(rec.protocol):
            note_incompatible(peer, rec.version, rec.protocol)  # its line, once per peer
            out.incompatible[peer] = rec
        elif rec.role == "leaving":
            out.leaving.append(peer)
        elif rec.role == "trainer":
            out.trainers[peer] = rec
    return out


def stopped_message(run_id: str, left: list[str]) -> str:
    return (f"the run's peers have stopped: {', '.join(short(p) for p in left)} left run {run_id!r} and no peer trains in it "
            "any more; start a new run (node join without --initial-peers) or join a live peer")


def incompatible_message(run_id: str, peers: dict[str, PeerRecord]) -> str:
    """Why a node refuses a run whose every peer runs another protocol version (each peer's own line,
    naming both versions, was logged once when its record was read)."""
    return (f"no peer of run {run_id!r} runs this node's protocol version {protocol_version()}: "
            f"{', '.join(short(p) for p in peers)} refused (the line above says which version to upgrade)")


def wait_for_peers(net: NetworkThread, run_id: str, me: str, wanted: int, timeout: float, stop: threading.Event,
                   answering: Callable[[set[str]], Awaitable[set[str]]] | None = None) -> int:
    """Hold until ``wanted`` trainers (this node included) are in the run, or the run already trains;
    returns how many there are. A line every ``LOG_EVERY_S`` says how many it has and whom it waits
    for. Raises :class:`NotStarted` after ``timeout`` seconds or when the run's peers have stopped,
    :class:`Interrupted` when ``stop`` is set.

    ``answering`` (``gossip.reachable.Reachable.check``): only trainers that answer a status probe count
    (a record signed by a key no daemon runs would release the barrier), and a record saying its peer left
    ends the wait only when this wait saw that peer train (one invented ``leaving`` record ended it)."""
    deadline = time.monotonic() + timeout
    next_log = 0.0
    seen: dict[str, float] = {}
    while True:
        now = time.monotonic()
        found = census(net, run_id, me)
        if answering is not None and found.trainers:
            live = net.call(answering(set(found.trainers)), timeout=30)
            found.trainers = {p: rec for p, rec in found.trainers.items() if p in live}
        seen.update({p: now for p in found.trainers})
        have = 1 + len(found.trainers)
        if have >= wanted or found.training:
            return have
        gone = sorted(p for p, t in seen.items() if p not in found.trainers and now - t > GONE_S)
        left = [p for p in found.leaving if answering is None or p in seen]
        if not found.trainers and (left or gone):
            raise NotStarted(stopped_message(run_id, left + [p for p in gone if p not in left]))
        names = ", ".join([f"{short(me)} (this node)"] + [short(p) for p in found.trainers])
        others = f"; not counted, another protocol version: {', '.join(short(p) for p in found.incompatible)}" if found.incompatible else ""
        if now >= deadline:
            raise NotStarted(f"only {have} of --min-peers {wanted} peers came to run {run_id!r} within --join-timeout "
                             f"{timeout:.0f}s ({names}{others}); start the others, lower --min-peers or raise --join-timeout")
        if now >= next_log:
            logger.info("waiting for --min-peers %d before the first step: %d in run %s (%s)%s; waiting for %d more, "
                        "%.0fs left of --join-timeout", wanted, have, run_id, names, others, wanted - have, deadline - now)
            next_log = now + LOG_EVERY_S
        if stop.wait(1.0):
            raise Interrupted()


def check_joinable(net: NetworkThread, run_id: str, me: str) -> None:
    """For a joiner that found no trainer to take the state from: raise :class:`NotStarted` when the
    run's peers have stopped, :class:`JoinRefused` when every peer runs another protocol version or the
    run is a private swarm whose key this node lacks (its records are sealed, ``protocol.peer_identity``)."""
    found = census(net, run_id, me)
    if found.trainers:
        return
    if net.validator is not None and net.validator.foreign_seals:
        raise JoinRefused(f"run {run_id!r} is a private swarm: its peers' records are sealed with a swarm key this node "
                          "does not hold. Ask its operator for the swarm key and pass it with --swarm-key FILE.")
    if found.incompatible:
        raise JoinRefused(incompatible_message(run_id, found.incompatible))
    if found.leaving:
        raise NotStarted(stopped_message(run_id, found.leaving))
