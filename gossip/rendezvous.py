"""Round rendezvous through the DHT: who is in the run, and who joins outer round r.

Every member keeps a signed PeerRecord under ``peers_key(run)`` (subkey = its peer id + public key,
so nobody else can overwrite it). For outer round r each member stores a RoundEntry under
``round_key(run, r)`` and polls until every live member that announced round r has registered, or
the gather deadline passes; late or dead members are left out of that round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from protocol.errors import SchemaError
from protocol.records import PeerRecord, RoundEntry, peers_key, round_key

logger = logging.getLogger(__name__)


def owned_subkey(peer_id: str, validator: RSASignatureValidator) -> bytes:
    """A subkey only the holder of ``validator``'s private key can write."""
    return peer_id.encode() + validator.local_public_key


def _peer_of_subkey(subkey: object) -> str | None:
    if isinstance(subkey, bytes):
        return subkey.split(b"[owner:", 1)[0].decode(errors="replace")
    return None


async def _read_subkeys(dht: DHTNode, key: str) -> dict[str, tuple[object, float]]:
    """{peer id: (value, expiration time)} of a key's owned subkeys."""
    found = await dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    out: dict[str, tuple[object, float]] = {}
    for subkey, item in found.value.items():
        peer = _peer_of_subkey(subkey)
        if peer is not None:
            out[peer] = (item.value, item.expiration_time)
    return out


async def publish_peer(dht: DHTNode, validator: RSASignatureValidator, run_id: str, record: PeerRecord, ttl: float) -> bool:
    """Store (refresh) this node's PeerRecord; it expires ``ttl`` seconds from now unless refreshed."""
    return await dht.store(
        peers_key(run_id), record.to_value(), get_dht_time() + ttl, subkey=owned_subkey(record.peer_id, validator)
    )


async def list_peers(dht: DHTNode, run_id: str) -> dict[str, PeerRecord]:
    """Live members of ``run_id`` with valid records (malformed records are dropped and logged)."""
    return {peer: record for peer, (record, _) in (await list_peers_with_expiry(dht, run_id)).items()}


async def list_peers_with_expiry(dht: DHTNode, run_id: str) -> dict[str, tuple[PeerRecord, float]]:
    """Like :func:`list_peers`, with each record's DHT expiration time."""
    peers: dict[str, tuple[PeerRecord, float]] = {}
    for peer, (value, expiration) in (await _read_subkeys(dht, peers_key(run_id))).items():
        try:
            record = PeerRecord.from_value(value)
        except SchemaError as e:
            logger.warning("ignoring malformed peer record of %s: %s", peer, e)
            continue
        if record.peer_id != peer:
            logger.warning("ignoring peer record of %s that claims to be %s", peer, record.peer_id)
            continue
        peers[peer] = (record, expiration)
    return peers


async def gather_group(
    dht: DHTNode,
    validator: RSASignatureValidator,
    run_id: str,
    round_no: int,
    entry: RoundEntry,
    expected: Callable[[], Awaitable[set[str]]],
    timeout: float,
    poll_interval: float = 0.2,
) -> list[RoundEntry]:
    """Register for round ``round_no`` and return the group (sorted by peer id, self included).

    Returns once every peer in ``expected()`` has registered, or after ``timeout`` seconds.
    """
    key = round_key(run_id, round_no)
    await dht.store(key, entry.to_value(), get_dht_time() + max(60.0, 4 * timeout), subkey=owned_subkey(entry.peer_id, validator))
    deadline = time.monotonic() + timeout
    entries: dict[str, RoundEntry] = {entry.peer_id: entry}
    while True:
        for peer, (value, _) in (await _read_subkeys(dht, key)).items():
            try:
                candidate = RoundEntry.from_value(value)
            except SchemaError as e:
                logger.warning("ignoring malformed round entry of %s: %s", peer, e)
                continue
            if candidate.peer_id == peer:
                entries[peer] = candidate
        waiting_for = (await expected()) - set(entries)
        if not waiting_for or time.monotonic() >= deadline:
            if waiting_for:
                logger.info("round %d: gave up waiting for %s", round_no, sorted(waiting_for))
            return [entries[p] for p in sorted(entries)]
        await asyncio.sleep(poll_interval)
