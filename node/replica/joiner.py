"""Bringing a whole-model replica into the run's state: join through a live peer, resync after
drifting out of the group, and catch up with the swarm's round.

:class:`Joiner` is handed the few things it needs (the network, the run, the state layout, the node's
settings, and a callback that adopts a downloaded state) and never the node itself, so the daemon's
training loop and these transitions stay apart.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from typing import Any, Awaitable, Callable, Sequence

import torch

from gossip.fingerprint import fingerprint
from gossip.rendezvous import list_peers, plausible_rounds, rejoin_target
from gossip.state_sources import SourcePlan, plan_sources
from gossip.state_transfer import DownloadedState, download_state
from node.runtime.barrier import check_joinable
from node.runtime.metrics import NodeMetrics
from node.runtime.network import NetworkThread
from node.runtime.settings import settings_mismatch
from protocol.errors import RemoteError
from protocol.ratelimit import RateLimits, announced_seconds

from node.errors import JoinRefused

logger = logging.getLogger("locomesh.node")
STATE_TIMEOUT_S = 120.0  # a whole state download, plus what --max-download-mbit adds
# a join asks again this many times, a second apart, when the peers' headers show no majority: a round that
# was ending splits honest peers between two states for a moment, and each peer's own header would otherwise
# be trusted, so a liar at the round the others had just left could be a joiner's source
NO_MAJORITY_RETRIES = 5


class StateRefused(Exception):
    """A downloaded state this node's judge refused to adopt (``Joiner.judge``: it scores far worse than its own)."""


Layout = dict[str, list[tuple[tuple[int, ...], torch.dtype]]]


class Joiner:
    """Downloads the swarm's state for a replica and hands it to ``adopt``.

    :param net: the node's running network thread
    :param run_id: the run whose peers are asked
    :param peer_id: this node (never asked)
    :param settings: this node's run settings (``node.runtime.settings.run_settings``); a swarm with others is refused
    :param layout: the tensors a state download must carry, by name
    :param adopt: takes over a downloaded state (weights, outer state, round, progress into the round)
    :param announce: publishes this node's DHT record at once (so a round's members wait for a joiner)
    :param event: records a node event
    :param held: the state this node holds now, by group (a join skips the groups a peer holds identically)
    :param judge: why a downloaded state must not replace this node's own in a resync (None: it may), e.g.
        ``node.replica.scoring.StateJudge``; a vote can still pick a hostile member's state (a start-up tie)
    """

    def __init__(self, *, net: NetworkThread, run_id: str, peer_id: str, settings: dict[str, Any], layout: Callable[[], Layout],
                 adopt: Callable[[DownloadedState], None], announce: Callable[[], Awaitable[None]], metrics: NodeMetrics,
                 event: Callable[..., None], stop: threading.Event, join_timeout: float,
                 held: Callable[[], dict[str, list[torch.Tensor]]] | None = None,
                 established: Callable[[str], bool] = lambda peer: False,
                 answering: Callable[[set[str]], Awaitable[set[str]]] | None = None,
                 measured: Callable[[str], float] = lambda peer: 0.0,
                 judge: Callable[[DownloadedState], str | None] | None = None) -> None:
        self.net, self.run_id, self.peer_id, self.settings = net, run_id, peer_id, settings
        self.layout, self.adopt, self.announce, self.held = layout, adopt, announce, held
        self.metrics, self.event, self.stop, self.join_timeout = metrics, event, stop, join_timeout
        self.up_caps: dict[str, float] = {}  # peers' announced --max-upload-mbit, from their last records read
        self.established = established  # whether this node saw a peer in enough of its rounds (gossip.votes)
        self.answering = answering  # the peers among some that answer a probe (gossip.reachable.Reachable.check)
        self.dissenters: set[str] = set()  # peers already logged and counted for serving a state other than the majority's
        self.measured = measured  # bytes/s this node measured from a peer's answers (0: never), which bound its announced cap
        self.judge = judge

    def _trainers(self) -> list[Any]:
        peers = self.net.call(list_peers(self.net.dht, self.run_id), timeout=30)
        self.up_caps = {p: rec.up_mbit for p, rec in peers.items()}
        return [rec for p, rec in peers.items() if p != self.peer_id and rec.role == "trainer"]

    def _plan(self, rounds: dict[str, int], prefer: str | None = None, min_round: int | None = None,
              fallback: bool = True) -> SourcePlan:
        """Whom to download from, in order, and the digests the state must match (``gossip.state_sources``):
        only the holders of the state a majority of up to five peers reports (of the established ones among
        them, when there are: this node's tenure), else each peer by its own header. Logs and counts the peers
        that answered with another state, or that announce a round far ahead."""
        plan = self.net.call(plan_sources(self.net.transport, rounds, self.run_id, self.layout(), prefer=prefer,
                                          min_round=min_round, fallback=fallback, established=self.established), timeout=30)
        poisoned = plan.left_out(f"run {self.run_id}", self.dissenters)
        if poisoned:
            self.metrics.errors.labels("poisoned").inc(len(poisoned))
        return plan

    def _first(self, plan: SourcePlan, what: str,
               accept: Callable[[DownloadedState], bool] = lambda got: True) -> DownloadedState | None:
        """The first download of ``plan`` that succeeds and that ``accept`` takes (each is adopted as it arrives,
        unless the judge refuses one that no majority vouches for first: :class:`StateRefused` is raised)."""
        for sources in plan.attempts:
            try:
                got = self.download_from(sources, trusted=plan.trusted, judged=plan.trusted is None)
            except StateRefused:
                raise
            except Exception as e:
                logger.warning("%s from %s failed: %s", what, ",".join(sources), e)
                continue
            if accept(got):
                return got
        return None

    def _answering(self, candidates: list[Any]) -> list[Any]:
        """The candidates that answer a status probe (all of them without a prober): a record signed by a key no
        daemon runs must not make the swarm's round, outvote the members, nor make a live peer look far ahead."""
        if self.answering is None or not candidates:
            return candidates
        live = self.net.call(self.answering({rec.peer_id for rec in candidates}), timeout=60)
        return [rec for rec in candidates if rec.peer_id in live]

    def join(self, resumed: bool) -> bool:
        """Download state from a live peer and take over its progress into the current round, so this
        node runs only the round's remaining inner steps and meets its peers at the rendezvous.

        Retries for ``join_timeout`` seconds; raises :class:`JoinRefused` when every peer refused this
        node's credentials (a private swarm and a missing or wrong ``--swarm-key``) or every peer that
        answered trains with other settings. A peer whose state is refused (other settings, bytes that do
        not match the digests) is skipped, never fatal: one peer cannot stop a newcomer."""
        deadline = time.monotonic() + self.join_timeout
        refusals: set[str] = set()
        mismatched: dict[str, str] = {}
        retries = NO_MAJORITY_RETRIES
        while not self.stop.is_set():
            candidates = self._trainers()
            try:  # all of them when none answers (a private swarm may refuse this node's probes: its downloads say so)
                candidates = self._answering(candidates) or candidates
            except Exception as e:
                logger.info("could not probe the run's peers: %s", e)
            try:
                plan = self._plan({rec.peer_id: rec.round for rec in candidates})
            except Exception as e:
                logger.warning("could not ask peers for their state's digests: %s", e)
                plan = SourcePlan([[rec.peer_id] for rec in candidates])
            if plan.trusted is None and len(candidates) > 1 and retries > 0 and time.monotonic() < deadline:
                retries -= 1
                logger.info("the run's peers hold no majority state yet (a round may be ending): asking again")
                self.stop.wait(1.0)
                continue
            trusted = plan.trusted
            for peers in plan.attempts:
                try:
                    got = self.download_from(peers, offer_held=True, trusted=trusted)
                except JoinRefused as e:
                    mismatched.update({p: str(e) for p in peers})
                    logger.warning("state of %s refused: %s", ",".join(peers), e)
                    continue
                except RemoteError as e:
                    logger.warning("state download from %s refused: %s", ",".join(peers), e)
                    self.metrics.state_downloads.labels("failed").inc()
                    if e.remote_code == "auth":
                        refusals.update(peers)
                    continue
                except Exception as e:
                    logger.warning("state download from %s failed: %s", ",".join(peers), e)
                    self.metrics.state_downloads.labels("failed").inc()
                    continue
                self.net.call(self.announce(), timeout=30)
                self.event("joined", peer=",".join(peers), round=got.snapshot.round, inner_step=got.inner_step, bytes=got.nbytes,
                           reused=got.reused, fingerprint=fingerprint(got.snapshot.tensors["params"]), peer_fingerprint=got.snapshot.fingerprint,
                           verified="majority" if trusted is not None else "own_header")
                return True
            if not candidates:
                check_joinable(self.net, self.run_id, self.peer_id)
            everyone = {rec.peer_id for rec in candidates}
            if candidates and refusals >= everyone:
                raise JoinRefused(
                    f"every peer of run {self.run_id!r} refused this node: it is a private swarm. "
                    "Ask its operator for the swarm key and pass it with --swarm-key FILE."
                )
            if candidates and set(mismatched) >= everyone - refusals:
                raise JoinRefused(next(iter(mismatched.values())))
            if time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        self.event("join_alone", reason="no peer of this run answered within --join-timeout; continuing from "
                   + ("the checkpoint" if resumed else "scratch"))
        return False

    def download_from(self, peer: str | list[str], offer_held: bool = False, trusted: dict[str, str] | None = None,
                      judged: bool = False) -> DownloadedState:
        """Download a peer's state, check its settings and adopt it; a progress bar on a terminal, else
        a log line per quarter. ``offer_held``: tell the peer what this node holds, so identical groups
        are not sent (worth it on joining: a node started from the run's seed or resumed at the swarm's round).
        ``trusted``: the group digests the state must match (the majority's). ``judged``: the judge sees the
        state before it is adopted (a state that replaces a trained one; a joiner's own may be untrained)."""
        logged = [-1]
        bar = None
        if sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            source = peer[-8:] if isinstance(peer, str) else (peer[0][-8:] if len(peer) == 1 else f"{len(peer)} peers")
            bar = Progress("state from " + source, BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True)
            task = bar.add_task("download", total=None)
            bar.start()

        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.update(task, completed=done, total=total)
                return
            quarter = 4 * done // max(total, 1)
            if quarter > logged[0]:
                logged[0] = quarter
                logger.info("downloading state from %s: %d%% of %.1f MB", peer, 25 * quarter, total / 1e6)

        try:
            held = self.held() if offer_held and self.held is not None else None
            layout = self.layout()
            got = self.net.call(download_state(self.net.transport, peer, self.run_id, layout, progress, held, trusted),
                                timeout=STATE_TIMEOUT_S + self._capped_seconds(layout, [peer] if isinstance(peer, str) else peer))
        finally:
            if bar is not None:
                bar.stop()
        mismatch = settings_mismatch(self.settings, got.snapshot.meta)
        if mismatch:
            raise JoinRefused(f"run {self.run_id!r} trains with {mismatch}; restart with the swarm's settings")
        why = self.judge(got) if judged and self.judge is not None else None
        if why:
            self.metrics.state_downloads.labels("refused").inc()
            raise StateRefused(f"state of {got.peer} at round {got.snapshot.round}: {why}")
        self.adopt(got)
        self.metrics.state_downloads.labels("ok").inc()
        return got

    def _capped_seconds(self, layout: Layout, sources: list[str]) -> float:
        """How long receiving a whole state of ``layout`` from ``sources`` (an even share each) takes at
        least under this node's ``--max-download-mbit`` and the upload caps the sources announced (claims,
        bounded by ``protocol.ratelimit.announced_seconds`` and by the rates measured from them)."""
        limits = getattr(self.net.transport, "limits", None) or RateLimits()
        size = sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for tensors in layout.values() for shape, dtype in tensors)
        share = size / max(1, len(sources))
        theirs = [announced_seconds(share, self.up_caps.get(p, 0.0), STATE_TIMEOUT_S, self.measured(p)) for p in sources]
        return max([limits.seconds_for(0, size), *theirs])

    def resync(self, peer: str | None, failed_round: int, members: Sequence[str] = ()) -> None:
        """Re-download the group's state after drifting out of it. ``peer``: the vote's choice among the
        round's majority; ``members``: the round's members that held the majority's φ. They publish the
        new state right after the round; only a state most of them report is adopted, from its holders
        (``peer`` first) and checked against their digests. When no majority shows within 20 tries (a tie,
        or one member), ``peer``'s state is taken, checked against its own header."""
        if peer is None:
            return
        if peer not in self.up_caps:  # its upload cap stretches the download's timeout
            try:
                self._trainers()
            except Exception as e:
                logger.info("could not read %s's record before resyncing: %s", peer, e)
        candidates = {p: failed_round + 1 for p in dict.fromkeys([peer, *members]) if p != self.peer_id}
        tries = 20
        for attempt in range(tries):
            try:
                plan = self._plan(candidates, prefer=peer, min_round=failed_round + 1, fallback=attempt == tries - 1)
            except Exception as e:
                logger.warning("could not ask the round's members for their state's digests: %s", e)
                plan = SourcePlan([[peer]] if attempt == tries - 1 else [])
            try:
                got = self._first(plan, "resync", accept=lambda got: got.snapshot.round > failed_round)
            except StateRefused as e:  # keep this node's own φ: the next round's vote decides again
                logger.warning("not resyncing: %s", e)
                self.event("resync_refused", peer=peer, round=failed_round, reason=str(e))
                return
            if got is not None:
                self.event("resynced", peer=got.peer, round=got.snapshot.round, fingerprint=got.snapshot.fingerprint,
                           verified="majority" if plan.trusted is not None else "own_header")
                return
            time.sleep(0.5)

    def catch_up(self, current_round: int, keep_weights: bool) -> int | None:
        """Rejoin the swarm's round after drifting away from it (see ``gossip.rendezvous.rejoin_target``):
        forward after finishing a round alone, back to the majority after racing ahead in a partition.

        Returns the round to continue in, or None to stay. With ``keep_weights`` (NoLoCo: replicas
        differ by design) only the round changes; otherwise the target round's state is downloaded."""
        try:
            others = self._trainers()
        except Exception as e:
            logger.info("could not list peers after the round: %s", e)
            return None
        others = self._answering(others)
        rounds = plausible_rounds(current_round, {rec.peer_id: rec.round for rec in others}, self.established)
        if len(rounds) < len(others):
            logger.warning("not following %d peer(s) announcing rounds far ahead of this node's %d that neither a majority "
                           "nor an established peer holds: %s", len(others) - len(rounds), current_round,
                           ", ".join(rec.peer_id[-8:] for rec in others if rec.peer_id not in rounds))
        others = [rec for rec in others if rec.peer_id in rounds]
        target = rejoin_target(current_round, list(rounds.values()))
        if target is None:
            return None
        direction = "forward" if target > current_round else "back_to_majority"
        if keep_weights:
            self.event("caught_up", peer="", round=target, direction=direction, from_round=current_round)
            return target
        holding = {rec.peer_id: rec.round for rec in others if rec.round == target}
        source = max(holding, key=lambda p: (self.established(p), p))
        try:
            plan = self._plan(holding, prefer=source, min_round=target)
        except Exception as e:
            logger.warning("could not ask the peers of round %d for their state's digests: %s", target, e)
            plan = SourcePlan([[source]])
        try:
            got = self._first(plan, f"rejoining round {target}")
        except StateRefused as e:
            logger.warning("not rejoining round %d: %s", target, e)
            self.event("resync_refused", peer=source, round=target, reason=str(e))
            return None
        if got is None:
            return None
        self.event("caught_up", peer=got.peer, round=got.snapshot.round, direction=direction)
        return got.snapshot.round
