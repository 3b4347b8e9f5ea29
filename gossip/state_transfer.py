"""State download for joiners over ``/locomesh/state/1.0``.

A serving node keeps an immutable :class:`StateSnapshot` (replaced at every round end; a replica's is built
on a joiner's first request) and answers ``get_state {run_id}`` with a ``state`` header (round, progress
into the round, fingerprint, meta, tensor layout) followed by ``chunk`` frames of raw bytes and an ``end``
frame. It runs on its own protocol, independent of averaging, so a round in progress never blocks a
joiner. The receiver checks the announced layout against its own model before it allocates anything.

A joiner may download from several peers that hold the same state at once: ``stripe [k, n]`` asks a
peer for the k-th of n even shares of the chunks (``stripe_of``), so no peer sends more than its share.

A requester may say what it already holds (``have``: a content digest per tensor group); groups whose
digest equals the snapshot's are listed as ``same`` in the header and not sent, so a joiner that starts
from the run's seed at round 0, or resumes a checkpoint of the current round, downloads only the header.

A download is a peer's claim until checked: the header carries the content digest of every tensor
group (over every byte), the receiver recomputes it over what arrived and refuses a state that does not
match — its own header's, every stripe's, and the digests a majority of peers reported (``trusted``,
from :func:`state_headers`: ``header_only`` requests that cost a peer one frame). One peer of four
stripes cannot poison its quarter, and a single peer cannot hand a joiner a state the others do not hold.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gossip.fingerprint import content_digest
from protocol import ids
from protocol.errors import SchemaError
from protocol.frames import require, require_token
from protocol.hivemind_transport import Transport
from protocol.tensors import check_shape, dtype_name

logger = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
MAX_STRIPES = 16


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


Expected = dict[str, list[tuple[tuple[int, ...], torch.dtype]]]


def chunk_plan(layout: dict[str, list[tuple[tuple[int, ...], torch.dtype]]], skip: Sequence[str] = ()) -> list[tuple[str, int, int, int]]:
    """Every chunk a full download carries, in order: (group, tensor, offset, length)."""
    plan = []
    for name, specs in layout.items():
        if name in skip:
            continue
        for i, (shape, dtype) in enumerate(specs):
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            plan.extend((name, i, offset, min(CHUNK_BYTES, size - offset)) for offset in range(0, size, CHUNK_BYTES))
    return plan


def stripe_of(plan: list[tuple[str, int, int, int]], k: int, n: int) -> list[tuple[str, int, int, int]]:
    """Stripe ``k`` of ``n``: the chunks dealt to it when each chunk in turn goes to the stripe with
    the fewest bytes so far (ties to the lowest), so no stripe exceeds an even share by more than a chunk."""
    loads = [0] * n
    mine = []
    for chunk in plan:
        target = min(range(n), key=lambda j: (loads[j], j))
        loads[target] += chunk[3]
        if target == k:
            mine.append(chunk)
    return mine


@dataclass
class _Header:
    round: int
    inner_step: int
    fingerprint: str
    meta: dict[str, Any]
    same: list[str]
    order: list[str]  # the groups in the peer's order (chunks follow it)
    digests: dict[str, str]  # content digest of each group, as the peer claims

    def agrees_with(self, other: "_Header") -> bool:
        return ((self.round, self.fingerprint, self.same, self.order, self.digests)
                == (other.round, other.fingerprint, other.same, other.order, other.digests))


def _check_header(body: dict, expected: Expected, have: dict[str, list[torch.Tensor]] | None) -> _Header:
    layout = require(body, "layout", dict)
    same = body.get("same", [])
    if set(layout) != set(expected):
        raise SchemaError(f"peer offers state groups {sorted(layout)}, this node needs {sorted(expected)}")
    if not isinstance(same, list) or not set(same) <= set(have or {}) & set(expected):
        raise SchemaError(f"peer reports groups {same!r} identical, but this node offered only {sorted(have or {})}")
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
    digests = require(body, "digests", dict)
    if set(digests) != set(expected) or not all(isinstance(d, str) and 0 < len(d) <= 128 for d in digests.values()):
        raise SchemaError(f"peer's state header must give a digest for each group {sorted(expected)}")
    return _Header(require(body, "round", int), require(body, "inner_step", int), require_token(body, "fingerprint"),
                   require(body, "meta", dict), sorted(same), list(layout), dict(digests))


class PoisonedState(SchemaError):
    """What arrived does not match the digests the peer (or the swarm's majority) reported."""


async def state_headers(transport: Transport, peers: Sequence[str], run_id: str, expected: Expected,
                        timeout: float = 10.0) -> dict[str, tuple[int, dict[str, str]]]:
    """Ask each peer for its snapshot's header only: {peer: (round, group digests)} of those that answered."""

    async def one(peer: str) -> tuple[int, dict[str, str]]:
        stream = await transport.open(peer, ids.STATE)
        try:
            await stream.send("get_state", {"run_id": run_id, "header_only": True})
            head = _check_header((await stream.recv(expect="state")).body, expected, None)
            await stream.recv(expect="end")
            return head.round, head.digests
        finally:
            transport.account(ids.STATE, stream)
            await stream.close()

    results = await asyncio.gather(*(asyncio.wait_for(one(p), timeout) for p in peers), return_exceptions=True)
    return {p: r for p, r in zip(peers, results) if isinstance(r, tuple)}


async def state_header(transport: Transport, peer: str, run_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """One peer's snapshot header (round, meta, layout, ...), unchecked: for a client that learns from the meta what
    to expect before it downloads (:func:`download_state` then checks the layout against that)."""

    async def one() -> dict[str, Any]:
        stream = await transport.open(peer, ids.STATE)
        try:
            await stream.send("get_state", {"run_id": run_id, "header_only": True})
            body = (await stream.recv(expect="state")).body
            await stream.recv(expect="end")
            require(body, "meta", dict)
            return body
        finally:
            transport.account(ids.STATE, stream)
            await stream.close()

    return await asyncio.wait_for(one(), timeout)


def majority_state(headers: dict[str, tuple[int, dict[str, str]]]) -> tuple[int, dict[str, str], list[str]] | None:
    """The (round, digests) most peers report, and those peers; None without a strict majority of at least
    two peers when more than one answered (ties are no majority: nobody's id decides)."""
    votes: dict[tuple[int, tuple[tuple[str, str], ...]], list[str]] = {}
    for peer, (round_no, digests) in headers.items():
        votes.setdefault((round_no, tuple(sorted(digests.items()))), []).append(peer)
    if not votes:
        return None
    ranked = sorted(votes.items(), key=lambda kv: -len(kv[1]))
    (round_no, digests), holders = ranked[0]
    if len(headers) > 1 and (len(holders) < 2 or (len(ranked) > 1 and len(ranked[1][1]) == len(holders))):
        return None
    return round_no, dict(digests), sorted(holders)


class _Assembly:
    """The buffers a download fills, shared by its stripes, and its progress."""

    def __init__(self, expected: Expected, on_progress: Callable[[int, int], None] | None) -> None:
        self.expected, self.on_progress = expected, on_progress
        self.buffers: dict[str, list[bytearray]] = {}
        self.received, self.total, self.nbytes = 0, 0, 0

    def write(self, name: str, i: int, offset: int, data: bytes) -> None:
        if name not in self.buffers:
            self.buffers[name] = [bytearray(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()) for s, d in self.expected[name]]
        self.buffers[name][i][offset : offset + len(data)] = data
        self.received += len(data)
        if self.on_progress is not None:
            self.on_progress(self.received, self.total)


async def _download_stripe(transport: Transport, peer: str, request: dict[str, Any], stripe: tuple[int, int], expected: Expected,
                           have: dict[str, list[torch.Tensor]] | None, assembly: _Assembly) -> _Header:
    """Fetch stripe ``(k, n)`` of ``peer``'s snapshot into ``assembly``; every chunk must be the next one
    of the stripe's plan, so nothing is written twice or left out."""
    stream = await transport.open(peer, ids.STATE)
    try:
        await stream.send("get_state", {**request, "stripe": list(stripe)} if stripe[1] > 1 else request)
        head = _check_header((await stream.recv(expect="state")).body, expected, have)
        ordered = {name: expected[name] for name in head.order}
        plan = chunk_plan(ordered, head.same)
        if not assembly.total:
            assembly.total = sum(length for *_, length in plan)
        for name, i, offset, length in stripe_of(plan, *stripe):
            msg = await stream.recv(expect="chunk")
            got = (require(msg.body, "g", str), require(msg.body, "t", int), require(msg.body, "offset", int))
            data = require(msg.body, "data", (bytes, memoryview))
            if got != (name, i, offset) or len(data) != length:
                raise SchemaError(f"chunk {got} of {len(data)} bytes arrived where {name!r}[{i}] at offset {offset} "
                                  f"({length} bytes) was due")
            assembly.write(name, i, offset, data)
        await stream.recv(expect="end")
        assembly.nbytes += stream.bytes_received
        return head
    finally:
        transport.account(ids.STATE, stream)
        await stream.close()


async def download_state(
    transport: Transport,
    peers: str | Sequence[str],
    run_id: str,
    expected: Expected,
    on_progress: Callable[[int, int], None] | None = None,
    have: dict[str, list[torch.Tensor]] | None = None,
    trusted: dict[str, str] | None = None,
) -> DownloadedState:
    """Download a snapshot; ``expected`` is the layout this node's model needs. With several ``peers``
    (that should hold the same state: the same round) each sends one stripe, an even share of the
    chunks; a stripe whose peer fails is fetched from one that answered. ``have``: the tensors this
    node holds now, by group; groups the peers report identical are taken from it, not sent. ``trusted``:
    the group digests the swarm's majority reported (:func:`majority_state`); a state whose bytes do not
    match them, or its own header's digests, raises :class:`PoisonedState`."""
    peers = [peers] if isinstance(peers, str) else list(peers)
    request: dict[str, Any] = {"run_id": run_id}
    if have:
        request["have"] = await asyncio.to_thread(group_digests, have)
    assembly = _Assembly(expected, on_progress)
    n = len(peers)
    results = await asyncio.gather(*(_download_stripe(transport, peer, request, (k, n), expected, have, assembly)
                                     for k, peer in enumerate(peers)), return_exceptions=True)
    served = [k for k, r in enumerate(results) if isinstance(r, _Header)]
    if not served:
        raise results[0]  # type: ignore[misc]
    for k, result in enumerate(results):
        if not isinstance(result, _Header):
            logger.info("state stripe %d of %d from %s failed (%s); fetching it from %s", k, n, peers[k], result, peers[served[0]])
            results[k] = await _download_stripe(transport, peers[served[0]], request, (k, n), expected, have, assembly)
    heads: list[_Header] = results  # type: ignore[assignment]
    if not all(h.agrees_with(heads[0]) for h in heads):
        raise SchemaError(f"peers {peers} hold different states (rounds {[h.round for h in heads]}); download from one")
    head = heads[0]
    if trusted is not None and head.digests != trusted:
        raise PoisonedState(f"peers {peers} offer a state other than the one most peers hold")
    tensors = {
        name: [
            (torch.frombuffer(buf, dtype=d).reshape(s).clone() if len(buf) else torch.empty(s, dtype=d))
            for buf, (s, d) in zip(assembly.buffers[name], expected[name])
        ]
        for name in assembly.buffers
    }
    held = have or {}
    for name in head.same:
        tensors[name] = [t.detach().to("cpu", copy=True) for t in held[name]]
    for name, specs in expected.items():  # a group with nothing but empty tensors has no chunks
        tensors.setdefault(name, [torch.empty(s, dtype=d) for s, d in specs])
    tensors = {name: tensors[name] for name in expected}
    for name, ts in tensors.items():
        for i, t in enumerate(ts):
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise SchemaError(f"downloaded state {name!r}[{i}] holds NaN or Inf")
    got = await asyncio.to_thread(group_digests, tensors)
    wrong = sorted(name for name in expected if got[name] != head.digests[name])
    if wrong:
        raise PoisonedState(f"state from {peers}: groups {wrong} do not match the digests their header reported")
    snap = StateSnapshot(round=head.round, tensors=tensors, fingerprint=head.fingerprint, meta=head.meta)
    # progress into the round is each holder's claim: the median of theirs, not one liar's maximum
    return DownloadedState(snapshot=snap, inner_step=statistics.median_low(h.inner_step for h in heads), peer=",".join(peers), nbytes=assembly.nbytes,
                           reused=list(head.same))


__all__ = ["DownloadedState", "PoisonedState", "StateServer", "StateSnapshot", "chunk_plan", "download_state", "majority_state",
           "state_header", "state_headers", "stripe_of"]


def meta_int(meta: dict[str, Any], key: str, low: int, high: int, default: int) -> int:
    """``meta[key]`` when it is an int in [low, high], else ``default`` (logged): a downloaded state's
    metadata is its source's claim."""
    value = meta.get(key, default)
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    logger.warning("a downloaded state's %s is %.40r, not a whole number in [%d, %d]: using %d", key, value, low, high, default)
    return default
