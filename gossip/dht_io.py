"""DHT reads and writes that a peer which stopped answering cannot hold up.

A frozen process (SIGSTOP, a laptop asleep, a machine swapping) keeps its p2pd running: streams to it open,
and requests wait for their timeout. Every read of the run's records asks each peer a node knows
(``gossip.rendezvous.read_subkeys``) and hivemind's store waits for the key's nearest nodes, so one such peer
held every member's reads 3 s and its stores 7–10 s each, round after round, past the rendezvous deadline.

- :func:`answers`: a read's requests go out at once; once half of them answered, the rest get a grace.
- :func:`store_owned`: a record goes into this node's own storage at once (readers ask this node too), and the
  nearest nodes' copies follow through hivemind's store.
- :func:`in_background` and :func:`waited`: a store (or a heartbeat) that a round waits for only so long runs on,
  its failure logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord

logger = logging.getLogger(__name__)

STRAGGLER_GRACE_S = 0.5  # after half the peers answered a read, the others get this long at least...
STRAGGLER_FACTOR = 4.0  # ...or this many times what that half took, whichever is longer


async def answers(ask: Callable[[object], Awaitable[dict | None]], peers: list, timeout: float) -> list[dict | None]:
    """``ask(peer)`` of every peer at once; once half of them answered, the rest get a grace (``STRAGGLER_GRACE_S``,
    or ``STRAGGLER_FACTOR`` × the time that took), never more than ``timeout`` in all. A peer that stopped answering
    (a frozen process whose p2pd still takes the stream) held every read ``timeout`` seconds, and every poll of every
    member's rendezvous with it; the copies a read merges are stored on several nodes, so a straggler's is seldom
    the only fresh one (the next read asks it again). Unanswered peers count as None."""
    if not peers:
        return []
    tasks = [asyncio.ensure_future(ask(p)) for p in peers]
    started = time.monotonic()
    end = started + timeout
    pending = set(tasks)
    try:
        while pending and len(tasks) - len(pending) < (len(tasks) + 1) // 2 and time.monotonic() < end:
            _, pending = await asyncio.wait(pending, timeout=end - time.monotonic(), return_when=asyncio.FIRST_COMPLETED)
        if pending:
            grace = max(STRAGGLER_GRACE_S, STRAGGLER_FACTOR * (time.monotonic() - started))
            await asyncio.wait(pending, timeout=max(0.0, min(end, time.monotonic() + grace) - time.monotonic()))
    finally:
        for task in tasks:
            task.cancel()  # (the finished ones are unaffected)
    return [t.result() if t.done() and not t.cancelled() else None for t in tasks]


async def store_owned(dht: DHTNode, key: str, subkey: bytes, value: object, expiration: float) -> bool:
    """An owned subkey's record: into this node's storage at once (readers ask every peer they know, this one
    included), then hivemind's store on the key's nearest nodes (seconds, when a peer stopped answering)."""
    store_here(dht, key, subkey, value, expiration)
    return await dht.store(key, value, expiration, subkey=subkey)


def store_here(dht: DHTNode, key: str, subkey: bytes, value: object, expiration: float) -> bool:
    """What hivemind's store does on this node when it is one of the key's nearest: the signed record into its storage."""
    key_id = DHTID.generate(source=key)
    serializer = dht.protocol.serializer
    record = DHTRecord(key_id.to_bytes(), serializer.dumps(subkey), serializer.dumps(value), expiration)
    checker = dht.protocol.record_validator
    if checker is not None:
        record = dataclasses.replace(record, value=checker.sign_value(record))
        if not checker.validate(record):
            return False
    return dht.protocol.storage.store(key_id, record.value, expiration, subkey=subkey)


def in_background(coro: Awaitable[object], what: str) -> "asyncio.Future":
    """``coro`` as a task that may outlive whoever waited for it: its failure is logged (``what`` failed), not lost."""
    task = asyncio.ensure_future(coro)

    def report(done: "asyncio.Future") -> None:
        if not done.cancelled() and done.exception() is not None:
            logger.warning("%s failed: %s", what, done.exception())

    task.add_done_callback(report)
    return task


async def waited(task: "asyncio.Future", seconds: float) -> bool:
    """Wait at most ``seconds`` for ``task`` without cancelling it; whether it finished (its failure is raised)."""
    try:
        await asyncio.wait_for(asyncio.shield(task), seconds)
        return True
    except asyncio.TimeoutError:
        return False
