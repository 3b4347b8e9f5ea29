"""All-gather of encoded pseudo-gradients inside a round's group, over ``/locomesh/average/1.0``.

Pull-based: each member publishes its contribution for round r locally; peers open a stream,
send ``fetch {run_id, round, codec}`` and receive ``contribution {round, samples, fingerprint,
codec, parts}`` followed by one ``part {i, payload}`` frame per wire part. The server waits up to
its serve timeout for its own contribution to be ready. Everything received is validated (codec,
part count, shapes, finite values) before it is used.

A fetch may name the parts it wants (``parts``: indices); only those are sent. Reduce-scatter
rounds (``gossip.reduce_scatter``) use that to collect the parts a member reduces, then
``fetch_reduced {run_id, round, codec, parts}`` to collect each owner's result: a ``reduced {round,
samples, contributors, fingerprint, parts}`` header and the owner's encoded parts.

What travels in round r is the round's *layout*: the shape and codec of every part. It is the same
on every member (derived from the model and the run's settings), may change from round to round
(streaming DiLoCo sends one fragment per round) and may mix codecs (NoLoCo sends Δ with the run's
codec and φ with a near-lossless one). ``wire`` names the run's wire settings; a request for other
settings is refused. A round averaged in a bounded group (``gossip.groups``) sends the members'
weights instead, under ``wire|gKofN`` (:meth:`RoundExchange.regroup`), so members that counted
another number of groups do not mix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from compression import CodecError, ErrorFeedback, get_codec
from compression.seeds import payload_seed
from gossip.failures import failure_reason
from gossip.round_waits import RoundWaits, event_in
from gossip.serve_budget import ServeBudget
from gossip.transfer_rates import TransferRates
from gossip.wire_parts import Layout, PartSpec, decode_received, fixed_layout
from protocol import ids
from protocol.errors import GroupClosed, ProtocolError, SchemaError, TruncatedFrame
from protocol.frames import FramedStream, require, require_token
from protocol.hivemind_transport import Transport

logger = logging.getLogger(__name__)
KEEP_ROUNDS = 2  # rounds served: the latest and the one before (each holds its parts: a dense round's are the model's size)


@dataclass
class Contribution:
    """One member's encoded update for a round."""

    round: int
    samples: int
    fingerprint: str
    codec: str
    parts: list[bytes]
    peer: str = ""
    decoded: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ReducedShare:
    """An owner's reduced parts of a round: the weighted mean over ``contributors`` (samples in all),
    encoded once, so every member decodes the same values. ``parts`` maps part index to its blob."""

    round: int
    samples: int
    contributors: list[str]
    fingerprint: str
    parts: dict[int, bytes]
    decoded: dict[int, torch.Tensor] = field(default_factory=dict)


class ExchangeError(Exception):
    """A member's contribution could not be obtained or was invalid."""


class RoundExchange:
    """Serves this node's contributions and fetches other members'.

    :param transport: the node's protocol transport
    :param run_id: only requests for this run are served
    :param wire: the run's wire settings (e.g. its codec); every member of the run must use the same
    :param layout: parts of round r (shape and codec each), identical on every member; a list of
        shapes means every round sends those shapes with the ``wire`` codec
    :param serve_timeout: how long a request may wait for this node's own contribution
    """

    def __init__(
        self,
        transport: Transport,
        run_id: str,
        wire: str,
        layout: Layout | Sequence[Sequence[int]],
        serve_timeout: float = 30.0,
    ) -> None:
        self.transport, self.run_id, self.wire = transport, run_id, wire
        self.layout: Layout = layout if callable(layout) else fixed_layout(wire, layout)
        self._contributions: dict[int, Contribution] = {}
        self._groups: dict[int, set[str]] = {}  # the members each round's rendezvous closed with (close_group)
        self._served: dict[int, set[str]] = {}  # the members each kept round was served to, whole
        self._ready: dict[int, asyncio.Event] = {}
        self._waits = RoundWaits(serve_timeout)  # requests for rounds not published yet (gossip.round_waits)
        self._budget = ServeBudget()  # how much of each round one client may still download (gossip.serve_budget)
        self._reduced: dict[int, ReducedShare | None] = {}
        self._reduced_ready: dict[int, asyncio.Event] = {}
        self._regrouped: dict[int, tuple[list[PartSpec], str]] = {}
        self.rates = TransferRates()  # how fast each peer's answers arrived (fetch deadlines grow with payload ÷ rate)
        # called with the round whenever a member asks for a contribution: it found its group complete, so
        # this node's rendezvous of that round, if it still runs, may look again at once (gather_group's poke)
        self.asked: Callable[[int], None] | None = None

    def regroup(self, round_no: int, specs: Sequence[PartSpec], tag: str) -> None:
        """Round ``round_no`` averages in a bounded group (``gossip.groups``): it sends ``specs`` instead of
        the run's layout, under the wire settings ``wire|tag``, so only members of the same group match."""
        self._regrouped[round_no] = (list(specs), tag)
        for old in [r for r in self._regrouped if r <= round_no - KEEP_ROUNDS]:
            self._regrouped.pop(old, None)

    def specs(self, round_no: int) -> Sequence[PartSpec]:
        """The parts of round ``round_no``: the run's layout, or what :meth:`regroup` set for that round."""
        regrouped = self._regrouped.get(round_no)
        return regrouped[0] if regrouped else self.layout(round_no)

    def wire_of(self, round_no: int) -> str:
        """The wire settings of round ``round_no`` (the run's, plus the group's tag in a grouped round)."""
        regrouped = self._regrouped.get(round_no)
        return f"{self.wire}|{regrouped[1]}" if regrouped else self.wire

    async def start(self) -> None:
        await self.transport.serve(ids.AVERAGE, self._handle)

    def publish_reduced(self, round_no: int, share: ReducedShare | None) -> None:
        """Serve this owner's reduced parts of ``round_no`` (None: it has none, so askers stop waiting)."""
        # kept to serve: the wire parts (the owner's round holds its decoded values while it needs them)
        self._reduced[round_no] = None if share is None else replace(share, decoded={})
        event_in(self._reduced_ready, round_no).set()
        for old in [r for r in self._reduced if r <= round_no - KEEP_ROUNDS]:
            self._reduced.pop(old, None)
            self._reduced_ready.pop(old, None)
        self._budget.forget("reduced parts", up_to=round_no - KEEP_ROUNDS)

    def publish(self, contribution: Contribution) -> None:
        """Make this node's contribution for ``contribution.round`` available to its group."""
        # kept to serve: the wire parts only (decoded values of a lossy codec are a float32 copy of the model)
        self._contributions[contribution.round] = replace(contribution, decoded=[])
        event_in(self._ready, contribution.round).set()
        rounds = set(self._contributions) | set(self._ready) | set(self._groups) | set(self._served)  # (released or not)
        for old in [r for r in rounds if r <= contribution.round - KEEP_ROUNDS]:
            self._contributions.pop(old, None)
            self._ready.pop(old, None)
            self._groups.pop(old, None)
            self._served.pop(old, None)
        self._budget.forget("contribution", up_to=contribution.round - KEEP_ROUNDS)
        self._release_served()

    def _release_served(self) -> None:
        """Stop keeping a past round every other member of its group has downloaded whole: nobody else may
        ask for it (the group closed), and a dense round's parts are the size of the model."""
        latest = max(self._contributions, default=-1)
        me = self.transport.peer_id
        for r in [r for r in self._contributions if r < latest and r in self._groups]:
            if self._groups[r] - {me} <= self._served.get(r, set()):
                del self._contributions[r]

    def close_group(self, round_no: int, members: set[str]) -> None:
        """This node's rendezvous of ``round_no`` closed with ``members``: a peer outside them that asks for
        the contribution later (it registered after the close) is refused, so it cannot average with this
        node's update while this node averages without its: every member agrees on who contributed."""
        self._groups[round_no] = members

    def encode(
        self, round_no: int, parts: Sequence[torch.Tensor], feedback: Sequence[ErrorFeedback | None] | None = None
    ) -> tuple[list[bytes], list[torch.Tensor]]:
        """Encode round ``round_no``'s parts (with error feedback where given); also returns what
        receivers will decode, so the sender averages exactly the values its peers see."""
        specs = self.specs(round_no)
        if len(parts) != len(specs):
            raise ValueError(f"round {round_no} sends {len(specs)} parts, got {len(parts)}")
        return self.encode_parts(round_no, range(len(specs)), parts, feedback)

    def encode_parts(
        self, round_no: int, indices: Sequence[int], parts: Sequence[torch.Tensor], feedback: Sequence[ErrorFeedback | None] | None = None
    ) -> tuple[list[bytes], list[torch.Tensor]]:
        """Encode the given parts of round ``round_no`` (part ``indices[j]`` is ``parts[j]``), as :meth:`encode`."""
        specs = self.specs(round_no)
        blobs, decoded = [], []
        for j, (i, part) in enumerate(zip(indices, parts)):
            codec = get_codec(specs[i].codec)
            seed = payload_seed(self.run_id, round_no, self.transport.peer_id, i)
            payload = codec.encode(part, state=feedback[j] if feedback else None, seed=seed)
            blobs.append(payload.to_bytes())
            decoded.append(codec.decode_view(payload))  # a view into the blob where lossless: read only
        return blobs, decoded

    def _selection(self, body: dict, round_no: int) -> list[int] | None:
        """The part indices a request names (None: all), each checked against the round's layout."""
        wanted = body.get("parts")
        if wanted is None:
            return None
        n = len(self.specs(round_no))
        if not isinstance(wanted, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in wanted):
            raise SchemaError(f"'parts' must list part indices of round {round_no} (0..{n - 1})")
        if len(set(wanted)) != len(wanted):
            raise SchemaError("'parts' names a part twice")
        return wanted

    async def _handle(self, stream: FramedStream) -> None:
        msg = await stream.recv(expect=("fetch", "fetch_reduced"))
        run_id = require(msg.body, "run_id", str)
        round_no = require(msg.body, "round", int)
        wire = require(msg.body, "codec", str)
        if run_id != self.run_id:
            raise SchemaError(f"this node trains run {self.run_id!r}, not {run_id!r}")
        reduced = msg.kind == "fetch_reduced"
        if not reduced and self.asked is not None:
            self.asked(round_no)
        if wire != self.wire_of(round_no) and round_no > max(self._contributions, default=-1):  # not yet published
            # a grouped round's tag is set just before this node publishes the round: a member that found
            # its group first may ask before that (seen under load), so judge the wire once it is published
            await self._waits.wait(self._reduced_ready if reduced else self._ready, round_no,
                                   "reduced parts" if reduced else "contribution", stream.peer)
        if wire != self.wire_of(round_no):
            raise SchemaError(f"wire mismatch: this run averages round {round_no} with {self.wire_of(round_no)!r}, request asked for {wire!r}")
        selection = self._selection(msg.body, round_no)
        if reduced:
            await self._serve_reduced(stream, round_no, selection)
            return
        latest = max(self._contributions, default=-1)
        if round_no <= latest - KEEP_ROUNDS:
            raise SchemaError(f"round {round_no} is over (this node is at round {latest})")
        await self._waits.wait(self._ready, round_no, "contribution", stream.peer)
        if stream.peer not in self._groups.get(round_no, (stream.peer,)):  # (before "over": a released round closed too)
            raise GroupClosed(f"this node's group of round {round_no} closed without {stream.peer}")
        c = self._contributions.get(round_no)
        if c is None:
            raise SchemaError(f"round {round_no} is over")
        chosen = range(len(c.parts)) if selection is None else selection
        head = {"round": c.round, "samples": c.samples, "fingerprint": c.fingerprint, "codec": c.codec, "parts": len(chosen)}
        await self._send_budgeted(stream, "contribution", head, round_no, c.parts, chosen)
        if selection is None:
            self._served.setdefault(round_no, set()).add(stream.peer)
            self._release_served()

    async def _serve_reduced(self, stream: FramedStream, round_no: int, selection: list[int] | None) -> None:
        if round_no not in self._reduced and round_no < max(self._contributions, default=-1):
            raise SchemaError(f"this node reduced no parts of round {round_no} and has moved on")  # it never will
        await self._waits.wait(self._reduced_ready, round_no, "reduced parts", stream.peer)
        share = self._reduced.get(round_no)
        if share is None:
            raise SchemaError(f"this node reduces no parts of round {round_no}")
        chosen = sorted(share.parts) if selection is None else selection
        missing = [i for i in chosen if i not in share.parts]
        if missing:
            raise SchemaError(f"this node does not reduce parts {missing} of round {round_no}")
        head = {"round": share.round, "samples": share.samples, "contributors": share.contributors,
                "fingerprint": share.fingerprint, "parts": len(chosen)}
        await self._send_budgeted(stream, "reduced", head, round_no, share.parts, chosen)

    async def _send_budgeted(self, stream: FramedStream, kind: str, head: dict, round_no: int,
                             parts: Sequence[bytes] | dict[int, bytes], chosen: Sequence[int]) -> None:
        """Send ``head`` (a ``kind`` frame) and the ``chosen`` parts, within what this client may still
        download of the round (``gossip.serve_budget``: a broken stream gives back what it did not send)."""
        table = "reduced parts" if kind == "reduced" else kind
        whole = sum(len(p) for p in (parts.values() if isinstance(parts, dict) else parts))
        wanted = sum(len(parts[i]) for i in chosen)
        self._budget.reserve(table, round_no, stream.peer, wanted, whole)
        sent = 0
        try:
            await stream.send(kind, head)
            for i in chosen:
                await stream.send("part", {"i": i, "payload": parts[i]})
                sent += len(parts[i])
        finally:
            self._budget.give_back(table, round_no, stream.peer, wanted - sent)

    async def _receive_parts(self, stream: FramedStream, peer: str, round_no: int,
                             chosen: Sequence[int]) -> tuple[list[bytes], list[torch.Tensor]]:
        """The ``part`` frames of ``chosen`` (in that order), each checked and decoded; how fast they
        arrived from ``peer`` is recorded (``rates``)."""
        specs = self.specs(round_no)
        parts, decoded = [], []
        started, before = time.monotonic(), stream.bytes_received
        for i in chosen:
            msg = await stream.recv(expect="part")
            if require(msg.body, "i", int) != i:
                raise SchemaError(f"part {msg.body.get('i')} arrived where part {i} was expected")
            blob = require(msg.body, "payload", (bytes, memoryview))  # (a view of the frame: protocol.frames)
            decoded.append(await decode_received(blob, i, specs[i], stream.max_frame))
            parts.append(blob)
        self.rates.observe(peer, stream.bytes_received - before, time.monotonic() - started)
        return parts, decoded

    async def fetch_reduced(self, owner: str, round_no: int, parts: Sequence[int]) -> ReducedShare:
        """Download an owner's reduced ``parts`` of ``round_no``; raises on anything invalid."""
        stream = await self.transport.open(owner, ids.AVERAGE)
        try:
            await stream.send("fetch_reduced", {"run_id": self.run_id, "round": round_no, "codec": self.wire_of(round_no), "parts": list(parts)})
            head = await stream.recv(expect="reduced")
            if require(head.body, "round", int) != round_no:
                raise SchemaError(f"asked for round {round_no}, got {head.body['round']}")
            if require(head.body, "parts", int) != len(parts):
                raise SchemaError(f"owner sent {head.body['parts']} reduced parts, asked for {len(parts)}")
            samples = require(head.body, "samples", int)
            contributors = require(head.body, "contributors", list)
            if samples <= 0 or not contributors or not all(isinstance(c, str) for c in contributors):
                raise SchemaError("a reduced share must name its contributors and carry a positive sample count")
            blobs, decoded = await self._receive_parts(stream, owner, round_no, parts)
            return ReducedShare(round_no, samples, contributors, require_token(head.body, "fingerprint"),
                                dict(zip(parts, blobs)), dict(zip(parts, decoded)))
        finally:
            self.transport.account(ids.AVERAGE, stream)
            await stream.close()

    async def fetch(self, peer: str, round_no: int, parts: Sequence[int] | None = None) -> Contribution:
        """Download and decode ``peer``'s contribution for ``round_no`` (only ``parts``, in that order,
        when given: the contribution's lists then hold those); raises on anything invalid."""
        stream = await self.transport.open(peer, ids.AVERAGE)
        try:
            request = {"run_id": self.run_id, "round": round_no, "codec": self.wire_of(round_no)}
            if parts is not None:
                request["parts"] = list(parts)
            await stream.send("fetch", request)
            head = await stream.recv(expect="contribution")
            got_round = require(head.body, "round", int)
            samples = require(head.body, "samples", int)
            n_parts = require(head.body, "parts", int)
            codec = require(head.body, "codec", str)
            fp = require_token(head.body, "fingerprint")
            if got_round != round_no:
                raise SchemaError(f"asked for round {round_no}, got {got_round}")
            if codec != self.wire_of(round_no):
                raise SchemaError(f"wire mismatch: peer sent {codec!r}, this run uses {self.wire_of(round_no)!r}")
            chosen = list(range(len(self.specs(round_no)))) if parts is None else list(parts)
            if n_parts != len(chosen):
                raise SchemaError(f"peer sent {n_parts} parts, asked for {len(chosen)} of round {round_no}")
            if samples < 0:  # 0: a member that took no step joins to keep φ; its Δ is not averaged (gossip.diloco)
                raise SchemaError(f"a contribution's sample count cannot be negative, got {samples}")
            blobs, decoded = await self._receive_parts(stream, peer, round_no, chosen)
            return Contribution(round_no, samples, fp, codec, blobs, peer=peer, decoded=decoded)
        finally:
            self.transport.account(ids.AVERAGE, stream)
            await stream.close()

    async def gather(self, peers: Sequence[str], round_no: int, timeout: float, parts: Sequence[int] | None = None,
                     reduced: dict[str, list[int]] | None = None,
                     retry_for: float | None = None,
                     expected: int | dict[str, int] = 0) -> tuple[dict[str, Contribution | ReducedShare], dict[str, str]]:
        """Fetch from every peer concurrently (its contribution, only ``parts`` of it when given, or
        with ``reduced`` the parts it reduced); returns (results, failures by peer with the reason).
        A broken connection is retried for ``retry_for`` seconds (default: the whole timeout).
        ``expected``: the bytes each answer holds (one number for all, or by peer): a fetch's timeout
        grows by the time they need at the rate measured from that peer (``gossip.transfer_rates``)."""

        def request(peer: str):
            if reduced is not None:
                return self.fetch_reduced(peer, round_no, reduced[peer])
            return self.fetch(peer, round_no, parts)

        async def one(peer: str) -> Contribution | ReducedShare:
            # a broken connection (a relay that went away, a reset circuit) is retried while the deadline
            # allows: the transport takes another path (the next relay, or a direct stream)
            nbytes = expected.get(peer, 0) if isinstance(expected, dict) else expected
            deadline = time.monotonic() + timeout + self.rates.slack(peer, nbytes, timeout)
            retry_until = deadline if retry_for is None else time.monotonic() + retry_for
            while True:
                try:
                    return await asyncio.wait_for(request(peer), timeout=max(0.1, deadline - time.monotonic()))
                except (ConnectionError, EOFError, TruncatedFrame, P2PDaemonError, P2PHandlerError) as e:
                    if min(deadline, retry_until) - time.monotonic() < 1.0:
                        raise
                    logger.info("round %d: fetch from %s broke (%s: %s); retrying", round_no, peer, type(e).__name__, e)
                    await asyncio.sleep(0.5)

        results = await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)
        got: dict[str, Contribution | ReducedShare] = {}
        failed: dict[str, str] = {}
        for peer, result in zip(peers, results):
            if isinstance(result, (Contribution, ReducedShare)):
                got[peer] = result
            elif isinstance(result, BaseException):
                failed[peer] = failure_reason(result, f"fetching round {round_no} from {peer}")
                if isinstance(result, (ProtocolError, CodecError)):
                    logger.warning("round %d: rejected contribution of %s: %s", round_no, peer, result)
                elif failed[peer] != "internal":
                    logger.info("round %d: could not fetch from %s: %s: %s", round_no, peer, type(result).__name__, result)
        return got, failed
