"""The serving side of state transfer (``/locomesh/state/1.0``, the protocol in ``gossip.state_transfer``):
the snapshot a node serves joiners, its digests, and the stripes of chunks it sends.

A replica *offers* its state: the copy of φ and momentum is built on a joiner's first request, not after
every round, and the offer is *withdrawn* just before the next outer step (or a resync) changes what it
reads, so joiners keep a source through the next round's rendezvous and exchange.
Most rounds nobody asks, and each copy (twice the model's size) cost every round a pass over the model and
the memory to hold it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from gossip.state_transfer import MAX_STRIPES, StateSnapshot, chunk_plan, group_digests, stripe_of
from protocol import ids
from protocol.errors import SchemaError
from protocol.frames import FramedStream, require
from protocol.hivemind_transport import Transport
from protocol.tensors import dtype_name, tensor_bytes


class StateServer:
    """Serves the current snapshot; ``progress()`` tells how many inner steps into the round we are."""

    def __init__(self, transport: Transport, run_id: str, progress: Callable[[], int]) -> None:
        self.transport, self.run_id, self.progress = transport, run_id, progress
        self.snapshot: StateSnapshot | None = None
        self._digests: tuple[StateSnapshot, dict[str, str]] | None = None
        self._build: Callable[[], StateSnapshot] | None = None  # an offer not built yet (:meth:`offer`)
        self._building = threading.Lock()  # held while an offer is built: what it reads must not change meanwhile

    async def start(self) -> None:
        await self.transport.serve(ids.STATE, self._handle)

    def publish(self, snapshot: StateSnapshot | None) -> None:
        """Serve ``snapshot`` from now on (None: nothing, until the next)."""
        self.snapshot = snapshot
        self._digests = None  # (it refers to the snapshot it was computed for, and would keep it alive)

    def renew(self, build: Callable[[], StateSnapshot]) -> None:
        """Serve ``build()``, built now, instead of the current snapshot, letting the current one go first: a snapshot is a
        copy of the model's state (φ and momentum), and two of them side by side were a round's peak. A joiner
        that asks meanwhile hears there is no state yet and asks another source; downloads under way keep
        the snapshot they started with."""
        self.offer(build)
        self._built()

    def offer(self, build: Callable[[], StateSnapshot]) -> None:
        """Serve ``build()`` from now on, built when a joiner first asks for it (most rounds nobody does). What
        ``build`` reads must stay as it is until :meth:`withdraw`."""
        with self._building:
            self.publish(None)
            self._build = build

    def withdraw(self) -> None:
        """What the offer reads is about to change: stop offering it (joiners hear there is no state yet until
        the next offer). Waits for a build under way; a snapshot already built stays served."""
        with self._building:
            self._build = None

    def _built(self) -> StateSnapshot | None:
        """The snapshot to serve, building the offer if there is one (in a worker thread: it copies the model)."""
        with self._building:
            if self._build is not None:
                self.publish(self._build())
                self._build = None
            return self.snapshot

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
        stripe = msg.body.get("stripe", [0, 1])
        if not (isinstance(stripe, list) and len(stripe) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in stripe)
                and 0 <= stripe[0] < stripe[1] <= MAX_STRIPES):
            raise SchemaError(f"get_state 'stripe' must be [k, n] with 0 <= k < n <= {MAX_STRIPES}")
        snap = self.snapshot if self._build is None else await asyncio.to_thread(self._built)
        if snap is None:
            raise SchemaError("this node has no state to share yet")
        layout = {name: [[list(t.shape), dtype_name(t.dtype)] for t in ts] for name, ts in snap.tensors.items()}
        digests = await self.digests(snap)
        same = sorted(name for name, digest in digests.items() if have and have.get(name) == digest)
        await stream.send(
            "state",
            {"round": snap.round, "inner_step": int(self.progress()), "fingerprint": snap.fingerprint, "meta": snap.meta, "layout": layout,
             "same": same, "digests": digests},
        )
        if msg.body.get("header_only") is True:
            await stream.send("end", {})
            return
        k, n = stripe
        plan = chunk_plan({name: [(tuple(t.shape), t.dtype) for t in ts] for name, ts in snap.tensors.items()}, same)
        raw: tuple[tuple[str, int], bytes] | None = None
        for name, i, offset, length in stripe_of(plan, k, n):
            if raw is None or raw[0] != (name, i):
                raw = ((name, i), tensor_bytes(snap.tensors[name][i]))
            await stream.send("chunk", {"g": name, "t": i, "offset": offset, "data": raw[1][offset : offset + length]})
        await stream.send("end", {})
