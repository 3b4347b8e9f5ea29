"""State download for joiners over ``/locomesh/state/1.0``.

A serving node keeps an immutable :class:`StateSnapshot` (replaced at every round end) and answers
``get_state {run_id}`` with a ``state`` header (round, progress into the round, fingerprint, meta,
tensor layout) followed by ``chunk`` frames of raw bytes and an ``end`` frame. It runs on its own
protocol, independent of averaging, so a round in progress never blocks a joiner. The receiver
checks the announced layout against its own model before it allocates anything.

A requester may say what it already holds (``have``: a content digest per tensor group); groups whose
digest equals the snapshot's are listed as ``same`` in the header and not sent, so a joiner that starts
from the run's seed at round 0, or resumes a checkpoint of the current round, downloads only the header.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gossip.fingerprint import content_digest
from protocol import ids
from protocol.errors import SchemaError
from protocol.frames import FramedStream, require
from protocol.hivemind_transport import Transport
from protocol.tensors import check_shape, dtype_name, tensor_bytes

logger = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class StateSnapshot:
    """What a joiner needs: the agreed weights, the outer optimizer's buffers, the round number."""

    round: int
    tensors: dict[str, list[torch.Tensor]]
    fingerprint: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class DownloadedState:
    snapshot: StateSnapshot
    inner_step: int
    peer: str
    nbytes: int
    reused: list[str] = field(default_factory=list)  # groups the peer held identically: not sent


def group_digests(groups: dict[str, list[torch.Tensor]]) -> dict[str, str]:
    """{group: content digest of its tensors}."""
    return {name: content_digest(ts) for name, ts in groups.items()}


class StateServer:
    """Serves the current snapshot; ``progress()`` tells how many inner steps into the round we are."""

    def __init__(self, transport: Transport, run_id: str, progress: Callable[[], int]) -> None:
        self.transport, self.run_id, self.progress = transport, run_id, progress
        self.snapshot: StateSnapshot | None = None
        self._digests: tuple[StateSnapshot, dict[str, str]] | None = None

    async def start(self) -> None:
        await self.transport.serve(ids.STATE, self._handle)

    def publish(self, snapshot: StateSnapshot) -> None:
        self.snapshot = snapshot

    async def digests(self, snap: StateSnapshot) -> dict[str, str]:
        """Content digest of each tensor group of ``snap`` (computed once per snapshot, on first ask,
        off the event loop: a large model takes seconds)."""
        cached = self._digests
        if cached is None or cached[0] is not snap:
            cached = (snap, await asyncio.to_thread(group_digests, snap.tensors))
            self._digests = cached
        return cached[1]

    async def _handle(self, stream: FramedStream) -> None:
        msg = await stream.recv(expect="get_state")
        if require(msg.body, "run_id", str) != self.run_id:
            raise SchemaError(f"this node trains run {self.run_id!r}, not {msg.body['run_id']!r}")
        have = msg.body.get("have", {})
        if not isinstance(have, dict):
            raise SchemaError("get_state 'have' must map tensor groups to digests")
        snap = self.snapshot
        if snap is None:
            raise SchemaError("this node has no state to share yet")
        layout = {name: [[list(t.shape), dtype_name(t.dtype)] for t in ts] for name, ts in snap.tensors.items()}
        same = sorted(name for name, digest in (await self.digests(snap)).items() if have and have.get(name) == digest)
        await stream.send(
            "state",
            {"round": snap.round, "inner_step": int(self.progress()), "fingerprint": snap.fingerprint, "meta": snap.meta, "layout": layout,
             "same": same},
        )
        for name, ts in snap.tensors.items():
            if name in same:
                continue
            for i, t in enumerate(ts):
                raw = tensor_bytes(t)
                for offset in range(0, len(raw), CHUNK_BYTES):
                    await stream.send("chunk", {"g": name, "t": i, "offset": offset, "data": raw[offset : offset + CHUNK_BYTES]})
        await stream.send("end", {})


async def download_state(
    transport: Transport,
    peer: str,
    run_id: str,
    expected: dict[str, list[tuple[tuple[int, ...], torch.dtype]]],
    on_progress: Callable[[int, int], None] | None = None,
    have: dict[str, list[torch.Tensor]] | None = None,
) -> DownloadedState:
    """Download ``peer``'s snapshot; ``expected`` is the layout this node's model needs. ``have``: the
    tensors this node holds now, by group; groups the peer reports identical are taken from it, not sent."""
    stream = await transport.open(peer, ids.STATE)
    try:
        request: dict[str, Any] = {"run_id": run_id}
        if have:
            request["have"] = await asyncio.to_thread(group_digests, have)
        await stream.send("get_state", request)
        head = await stream.recv(expect="state")
        round_no = require(head.body, "round", int)
        inner_step = require(head.body, "inner_step", int)
        fp = require(head.body, "fingerprint", str)
        meta = require(head.body, "meta", dict)
        layout = require(head.body, "layout", dict)
        same = head.body.get("same", [])
        if set(layout) != set(expected):
            raise SchemaError(f"peer offers state groups {sorted(layout)}, this node needs {sorted(expected)}")
        if not isinstance(same, list) or not set(same) <= set(have or {}) & set(expected):
            raise SchemaError(f"peer reports groups {same!r} identical, but this node offered only {sorted(have or {})}")
        buffers: dict[str, list[bytearray]] = {}
        total = 0
        for name, specs in expected.items():
            offered = layout[name]
            if not isinstance(offered, list) or len(offered) != len(specs):
                raise SchemaError(f"state group {name!r}: peer offers {len(offered) if isinstance(offered, list) else '?'} tensors, model has {len(specs)}")
            for i, ((shape, dtype), item) in enumerate(zip(specs, offered)):
                if not (isinstance(item, list) and len(item) == 2):
                    raise SchemaError(f"state group {name!r} tensor {i}: bad layout entry")
                got_shape = check_shape(item[0])
                if got_shape != tuple(shape) or item[1] != dtype_name(dtype):
                    raise SchemaError(
                        f"state group {name!r} tensor {i}: peer has {list(got_shape)} {item[1]}, "
                        f"this model needs {list(shape)} {dtype_name(dtype)} (same --model on every peer?)"
                    )
            if name in same:
                continue
            buffers[name] = [bytearray(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()) for s, d in specs]
            total += sum(len(b) for b in buffers[name])
        filled = {name: [0] * len(bufs) for name, bufs in buffers.items()}
        received = 0
        while True:
            msg = await stream.recv(expect=("chunk", "end"))
            if msg.kind == "end":
                break
            name = require(msg.body, "g", str)
            i = require(msg.body, "t", int)
            offset = require(msg.body, "offset", int)
            data = require(msg.body, "data", bytes)
            if name not in buffers or not 0 <= i < len(buffers[name]):
                raise SchemaError(f"chunk for unknown tensor {name!r}[{i}]")
            buf = buffers[name][i]
            if offset != filled[name][i] or offset + len(data) > len(buf):
                raise SchemaError(f"chunk of {name!r}[{i}] at offset {offset} does not continue the tensor")
            buf[offset : offset + len(data)] = data
            filled[name][i] += len(data)
            received += len(data)
            if on_progress is not None:
                on_progress(received, total)
        for name, bufs in buffers.items():
            for i, buf in enumerate(bufs):
                if filled[name][i] != len(buf):
                    raise SchemaError(f"state ended with {name!r}[{i}] incomplete ({filled[name][i]} of {len(buf)} bytes)")
        tensors = {
            name: [
                (torch.frombuffer(buf, dtype=d).reshape(s).clone() if len(buf) else torch.empty(s, dtype=d))
                for buf, (s, d) in zip(buffers[name], expected[name])
            ]
            for name in buffers
        }
        held = have or {}
        for name in same:
            tensors[name] = [t.detach().to("cpu", copy=True) for t in held[name]]
        tensors = {name: tensors[name] for name in expected}
        for name, ts in tensors.items():
            for i, t in enumerate(ts):
                if t.is_floating_point() and not torch.isfinite(t).all():
                    raise SchemaError(f"downloaded state {name!r}[{i}] holds NaN or Inf")
        snap = StateSnapshot(round=round_no, tensors=tensors, fingerprint=fp, meta=meta)
        return DownloadedState(snapshot=snap, inner_step=inner_step, peer=peer, nbytes=stream.bytes_received, reused=list(same))
    finally:
        transport.account(ids.STATE, stream)
        await stream.close()


__all__ = ["DownloadedState", "StateServer", "StateSnapshot", "download_state"]
