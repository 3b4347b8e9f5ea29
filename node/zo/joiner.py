"""Bringing a zeroth-order replica (``--algorithm zo``) to a live peer's weights and round.

A replica is its weights plus the round they belong to. :class:`ZOJoiner` reaches a peer's replica
the cheapest way: when the peer's log of applied rounds starts at this replica's round and
fingerprint (both began from the same ``--init-from``, or this node was briefly away), the logged
one-byte codes are replayed and no weights travel; otherwise the peer's snapshot is downloaded
(``/locomesh/state/1.0``; published every few rounds, so it may lag) and the rounds logged since are
replayed. Every replayed round is checked against the fingerprint the peer logged.

The joiner is handed the network, the code exchange, the replica and a snapshot publisher — never
the node — so the node's training loop and these transitions stay apart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gossip.fingerprint import fingerprint
from gossip.rendezvous import list_peers
from gossip.state_transfer import download_state
from gossip.state_sources import rank_candidates
from gossip.zo_exchange import CodeExchange, LogReply, replay
from node.errors import JoinRefused
from node.runtime.barrier import check_joinable
from node.runtime.metrics import NodeMetrics
from node.runtime.network import Interrupted, NetworkThread
from node.runtime.settings import settings_mismatch

logger = logging.getLogger("locomesh.node")
ZO_KEYS = ("zo_eps", "zo_lr", "zo_seed_pool")  # must agree across the swarm, besides node.runtime.settings.SWARM_KEYS


class SyncFailed(Exception):
    """A peer's snapshot or log did not lead to its weights."""


@dataclass
class Replica:
    """A zeroth-order replica: its weights (the model's parameters, changed in place), their round and
    fingerprint, and the steps taken in the round."""

    params: list[torch.Tensor]
    round: int = 0
    step: int = 0
    fp: str = ""
    snapshot_round: int = 0  # the round of the weights this node serves as its snapshot
    codes: list[int] = field(default_factory=list)


def settings_problems(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The settings in ``theirs`` (a peer's meta) that differ from ``mine``, as flags to change, or None."""
    found = [settings_mismatch(mine, theirs) or ""]
    found += [f"--{k.replace('_', '-')} {theirs[k]} (this node: {mine[k]})" for k in ZO_KEYS if k in theirs and theirs[k] != mine.get(k)]
    return ", ".join(f for f in found if f) or None


class ZOJoiner:
    """Syncs a replica with live peers of a zo run.

    :param net: the node's running network thread
    :param exchange: the node's code exchange (fetches logs, records replayed rounds)
    :param rep: the replica to bring up to date (weights changed in place)
    :param meta: this node's shared settings (``run_id`` included); a peer with others is refused
    :param publish_snapshot: serves the replica's current weights as this node's snapshot
    :param round_steps: H, the steps of a round
    """

    def __init__(self, *, net: NetworkThread, exchange: CodeExchange, rep: Replica, meta: dict[str, Any], peer_id: str,
                 publish_snapshot: Callable[[], None], round_steps: Callable[[], int], metrics: NodeMetrics,
                 event: Callable[..., None], stop: threading.Event, join_timeout: float, wait_timeout: float) -> None:
        self.net, self.exchange, self.rep, self.meta, self.peer_id = net, exchange, rep, meta, peer_id
        self.run_id, self.lr, self.pool = meta["run_id"], meta["zo_lr"], meta.get("zo_seed_pool", 0)
        self.publish_snapshot, self.round_steps, self.metrics, self.event = publish_snapshot, round_steps, metrics, event
        self.stop, self.join_timeout, self.wait_timeout = stop, join_timeout, wait_timeout

    def _check(self, theirs: dict[str, Any]) -> None:
        problems = settings_problems(self.meta, theirs)
        if problems:
            raise JoinRefused(f"run {self.run_id!r} trains with {problems}; restart with the swarm's settings")

    def _trainers(self) -> list[Any]:
        peers = self.net.run(list_peers(self.net.dht, self.run_id), self.stop)
        return [rec for p, rec in peers.items() if p != self.peer_id and rec.role == "trainer"]

    def join(self) -> tuple[str, str] | None:
        """Sync with a live peer near the round most peers announce (``gossip.state_sources.rank_candidates``:
        one announcing a round far ahead is not asked) that answers: (its peer id, how), or None when no peer
        answered within the join timeout (the node then trains alone). Raises :class:`JoinRefused` only
        when every trainer of the run disagrees (another algorithm, or other settings): one peer's record
        or meta is its word, and it is skipped, never allowed to stop a newcomer."""
        deadline = time.monotonic() + self.join_timeout
        while not self.stop.is_set():
            others = self._trainers()
            zo_peers = [rec for rec in others if rec.algorithm == "zo"]
            if others and not zo_peers:
                algorithms = sorted({rec.algorithm for rec in others})
                raise JoinRefused(f"run {self.run_id!r} trains with --algorithm {', '.join(algorithms)} (this node: zo); "
                                  "restart with the swarm's settings or another --run-id")
            refusals: list[JoinRefused] = []
            near, ahead = rank_candidates({rec.peer_id: rec.round for rec in zo_peers})
            if ahead:
                logger.warning("not syncing with %d peer(s) announcing rounds far ahead of the swarm's: %s", len(ahead), ", ".join(ahead))
            for peer in near:
                try:
                    return peer, self.sync_from(peer)
                except Interrupted:
                    raise
                except JoinRefused as e:
                    refusals.append(e)
                    logger.warning("not syncing with %s: %s", peer, e)
                except Exception as e:
                    logger.warning("could not sync with %s: %s", peer, e)
            if near and len(refusals) == len(near):
                raise refusals[0]
            if not others:
                check_joinable(self.net, self.run_id, self.peer_id)
            if time.monotonic() >= deadline:
                return None
            self.stop.wait(1.0)
        return None

    def _log_from(self, peer: str, first: int, after_round: int | None) -> LogReply:
        """``peer``'s log from ``first``; with ``after_round``, once the peer has finished that round."""
        until = time.monotonic() + self.wait_timeout
        while True:
            reply = self.net.run(asyncio.wait_for(self.exchange.fetch_log(peer, first), 30), self.stop)
            self._check(reply.meta)
            if after_round is None or reply.position.round > after_round:
                return reply
            if time.monotonic() > until:
                raise SyncFailed(f"{peer} did not finish round {after_round} in time")
            self.stop.wait(0.3)

    def _replayable(self, reply: LogReply) -> bool:
        at, rep = reply.position, self.rep
        return (at.round, at.fingerprint) == (rep.round, rep.fp) or any(
            (e.round, e.before) == (rep.round, rep.fp) for e in reply.entries)

    def sync_from(self, peer: str, after_round: int | None = None) -> str:
        """Reach ``peer``'s weights and round ("log": replay only, "snapshot+log": download, then replay);
        with ``after_round``, the weights after the peer finished that round."""
        rep, net = self.rep, self.net
        reply, how = self._log_from(peer, rep.round, after_round), "log"
        if not self._replayable(reply):
            layout = {"params": [(tuple(p.shape), torch.float32) for p in rep.params]}
            got = net.run(asyncio.wait_for(download_state(net.transport, peer, self.run_id, layout), 120), self.stop)
            self._check(got.snapshot.meta)
            with torch.no_grad():
                for p, t in zip(rep.params, got.snapshot.tensors["params"]):
                    p.copy_(t.to(p.device, p.dtype))
            rep.round, rep.fp = got.snapshot.round, fingerprint(rep.params)
            if rep.fp != got.snapshot.fingerprint:
                raise SyncFailed(f"{peer}'s snapshot does not match its fingerprint")
            self.metrics.state_downloads.labels("ok").inc()
            self.exchange.reset_log()  # older entries no longer lead to these weights
            self.publish_snapshot()
            reply, how = self._log_from(peer, rep.round, after_round), "snapshot+log"
            if not self._replayable(reply):
                raise SyncFailed(f"{peer}'s log does not reach back to its snapshot of round {rep.round}")
        for entry in replay(rep.params, reply.entries, rep.round, rep.fp, self.run_id, self.lr, self.pool):
            self.exchange.record(entry, rep.snapshot_round)
            rep.round, rep.fp = entry.round + 1, entry.after
        if (rep.round, rep.fp) != (reply.position.round, reply.position.fingerprint):
            raise SyncFailed(f"{peer}'s log ends at round {rep.round}, not at its round {reply.position.round}")
        # a round entered mid-way is sat out with zero codes (no update): whether or not the others'
        # rendezvous saw this node in time, every member then applies the same updates
        rep.step = self.round_steps() if reply.position.step > 0 else 0
        rep.codes = [0] * rep.step
        return how
