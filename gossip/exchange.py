"""All-gather of encoded pseudo-gradients inside a round's group, over ``/locomesh/average/1.0``.

Pull-based: each member publishes its contribution for round r locally; peers open a stream,
send ``fetch {run_id, round, codec}`` and receive ``contribution {round, samples, fingerprint,
codec, parts}`` followed by one ``part {i, payload}`` frame per wire part. The server waits up to
its serve timeout for its own contribution to be ready. Everything received is validated (codec,
part count, shapes, finite values) before it is used.

What travels in round r is the round's *layout*: the shape and codec of every part. It is the same
on every member (derived from the model and the run's settings), may change from round to round
(streaming DiLoCo sends one fragment per round) and may mix codecs (NoLoCo sends Δ with the run's
codec and φ with a near-lossless one). ``wire`` names the run's wire settings; a request for other
settings is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from compression import CodecError, ErrorFeedback, Payload, get_codec
from compression.seeds import payload_seed
from protocol import ids
from protocol.errors import ProtocolError, SchemaError, TruncatedFrame
from protocol.frames import FramedStream, require
from protocol.hivemind_transport import Transport

logger = logging.getLogger(__name__)
KEEP_ROUNDS = 3


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


@dataclass(frozen=True)
class PartSpec:
    """Shape and codec of one wire part."""

    shape: tuple[int, ...]
    codec: str


Layout = Callable[[int], Sequence[PartSpec]]


def fixed_layout(codec: str, shapes: Sequence[Sequence[int]]) -> Layout:
    """Every round sends the same parts with the same codec."""
    specs = [PartSpec(tuple(s), get_codec(codec).spec) for s in shapes]
    return lambda _round: specs


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
        self.serve_timeout = serve_timeout
        self._contributions: dict[int, Contribution] = {}
        self._ready: dict[int, asyncio.Event] = {}

    async def start(self) -> None:
        await self.transport.serve(ids.AVERAGE, self._handle)

    def _event(self, round_no: int) -> asyncio.Event:
        if round_no not in self._ready:
            self._ready[round_no] = asyncio.Event()
        return self._ready[round_no]

    def publish(self, contribution: Contribution) -> None:
        """Make this node's contribution for ``contribution.round`` available to its group."""
        self._contributions[contribution.round] = contribution
        self._event(contribution.round).set()
        for old in [r for r in self._contributions if r <= contribution.round - KEEP_ROUNDS]:
            self._contributions.pop(old, None)
            self._ready.pop(old, None)

    def encode(
        self, round_no: int, parts: Sequence[torch.Tensor], feedback: Sequence[ErrorFeedback | None] | None = None
    ) -> tuple[list[bytes], list[torch.Tensor]]:
        """Encode round ``round_no``'s parts (with error feedback where given); also returns what
        receivers will decode, so the sender averages exactly the values its peers see."""
        specs = self.layout(round_no)
        if len(parts) != len(specs):
            raise ValueError(f"round {round_no} sends {len(specs)} parts, got {len(parts)}")
        blobs, decoded = [], []
        for i, (part, spec) in enumerate(zip(parts, specs)):
            codec = get_codec(spec.codec)
            seed = payload_seed(self.run_id, round_no, self.transport.peer_id, i)
            payload = codec.encode(part, state=feedback[i] if feedback else None, seed=seed)
            blobs.append(payload.to_bytes())
            decoded.append(codec.decode(payload))
        return blobs, decoded

    async def _handle(self, stream: FramedStream) -> None:
        msg = await stream.recv(expect="fetch")
        run_id = require(msg.body, "run_id", str)
        round_no = require(msg.body, "round", int)
        wire = require(msg.body, "codec", str)
        if run_id != self.run_id:
            raise SchemaError(f"this node trains run {self.run_id!r}, not {run_id!r}")
        if wire != self.wire:
            raise SchemaError(f"wire mismatch: this run averages with {self.wire!r}, request asked for {wire!r}")
        latest = max(self._contributions, default=-1)
        if round_no <= latest - KEEP_ROUNDS:
            raise SchemaError(f"round {round_no} is over (this node is at round {latest})")
        try:
            await asyncio.wait_for(self._event(round_no).wait(), timeout=self.serve_timeout)
        except asyncio.TimeoutError:
            raise SchemaError(f"no contribution for round {round_no} within {self.serve_timeout:.0f}s") from None
        c = self._contributions.get(round_no)
        if c is None:
            raise SchemaError(f"round {round_no} is over")
        await stream.send(
            "contribution",
            {"round": c.round, "samples": c.samples, "fingerprint": c.fingerprint, "codec": c.codec, "parts": len(c.parts)},
        )
        for i, blob in enumerate(c.parts):
            await stream.send("part", {"i": i, "payload": blob})

    async def fetch(self, peer: str, round_no: int) -> Contribution:
        """Download and decode ``peer``'s contribution for ``round_no``; raises on anything invalid."""
        stream = await self.transport.open(peer, ids.AVERAGE)
        try:
            await stream.send("fetch", {"run_id": self.run_id, "round": round_no, "codec": self.wire})
            head = await stream.recv(expect="contribution")
            got_round = require(head.body, "round", int)
            samples = require(head.body, "samples", int)
            n_parts = require(head.body, "parts", int)
            codec = require(head.body, "codec", str)
            fp = require(head.body, "fingerprint", str)
            if got_round != round_no:
                raise SchemaError(f"asked for round {round_no}, got {got_round}")
            if codec != self.wire:
                raise SchemaError(f"wire mismatch: peer sent {codec!r}, this run uses {self.wire!r}")
            specs = self.layout(round_no)
            if n_parts != len(specs):
                raise SchemaError(f"peer sent {n_parts} parts, round {round_no} has {len(specs)}")
            if samples <= 0:
                raise SchemaError(f"a contribution must carry a positive sample count, got {samples}")
            parts, decoded = [], []
            for i, spec in enumerate(specs):
                shape, part_codec = spec.shape, get_codec(spec.codec)
                msg = await stream.recv(expect="part")
                if require(msg.body, "i", int) != i:
                    raise SchemaError(f"part {msg.body.get('i')} arrived where part {i} was expected")
                blob = require(msg.body, "payload", bytes)
                payload = Payload.from_bytes(blob, max_bytes=stream.max_frame, expected_shape=shape)
                if payload.codec != part_codec.spec:
                    raise SchemaError(f"part {i} is encoded with {payload.codec!r}, expected {part_codec.spec!r}")
                value = await asyncio.to_thread(part_codec.decode, payload)  # off the loop: it serves others meanwhile
                if tuple(value.shape) != shape:
                    raise SchemaError(f"part {i} has shape {list(value.shape)}, expected {list(shape)}")
                if not torch.isfinite(value).all():
                    raise SchemaError(f"part {i} holds NaN or Inf")
                parts.append(blob)
                decoded.append(value)
            return Contribution(round_no, samples, fp, codec, parts, peer=peer, decoded=decoded)
        finally:
            self.transport.account(ids.AVERAGE, stream)
            await stream.close()

    async def gather(self, peers: Sequence[str], round_no: int, timeout: float) -> tuple[dict[str, Contribution], dict[str, str]]:
        """Fetch from every peer concurrently; returns (contributions, failures by peer with the reason)."""

        async def one(peer: str) -> Contribution:
            # a broken connection (a relay that went away, a reset circuit) is retried while the deadline
            # allows: the transport takes another path (the next relay, or a direct stream)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    return await asyncio.wait_for(self.fetch(peer, round_no), timeout=max(0.1, deadline - time.monotonic()))
                except (ConnectionError, EOFError, TruncatedFrame, P2PDaemonError, P2PHandlerError) as e:
                    if deadline - time.monotonic() < 1.0:
                        raise
                    logger.info("round %d: fetch from %s broke (%s: %s); retrying", round_no, peer, type(e).__name__, e)
                    await asyncio.sleep(0.5)

        results = await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)
        got: dict[str, Contribution] = {}
        failed: dict[str, str] = {}
        for peer, result in zip(peers, results):
            if isinstance(result, Contribution):
                got[peer] = result
            elif isinstance(result, asyncio.TimeoutError):
                failed[peer] = "timeout"
            elif isinstance(result, (ProtocolError, CodecError)):
                failed[peer] = getattr(result, "code", "schema")
                logger.warning("round %d: rejected contribution of %s: %s", round_no, peer, result)
            elif isinstance(result, BaseException):
                failed[peer] = "connection"
                logger.info("round %d: could not fetch from %s: %s: %s", round_no, peer, type(result).__name__, result)
        return got, failed
