"""Claims on a lost pipeline stage: one rebuilder per stage.

Nodes see the stage map through DHT records that can be seconds old, so two would-be rebuilders that
each compute "am I the one?" from their own view can both move (CheckFree recovery, see
ALGORITHMS.md §6). Before moving, a candidate stores a claim for the stage (an owned subkey of
``locomesh.<run>.claim.<stage>`` with a short expiry), waits for other claims to propagate, and reads
them all back: the earliest claim wins (ties by peer id) and every other candidate stays where it is.
A claim by someone else that is still fresh keeps a candidate from claiming at all.

A claim's time is its writer's word, so a peer can win every claim (``at = 0``) and never rebuild. The
caller passes the claimers it has seen win a stage for a whole claim period without serving it
(``ignore``, kept by ``node.pipeline.recovery``): their claims neither stop a candidate nor win.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from gossip.rendezvous import read_subkeys
from protocol.peer_identity import owned_subkey

CLAIM_TTL_S = 30.0  # a rebuild takes seconds; a claimer that died frees the stage after this
CLAIM_SETTLE_S = 1.5  # how long claims are given to reach every candidate before the winner is read


def claim_key(run_id: str, stage: int) -> str:
    return f"locomesh.{run_id}.claim.{stage}"


async def read_claims(dht: DHTNode, run_id: str, stage: int) -> dict[str, float]:
    """{peer id: time of its claim} of the live claims on ``stage``."""
    now = get_dht_time()
    claims = {}
    for peer, (value, expiration) in (await read_subkeys(dht, claim_key(run_id, stage))).items():
        at = value.get("at") if isinstance(value, dict) else None
        if isinstance(at, (int, float)) and not isinstance(at, bool) and expiration > now and value.get("peer_id") == peer:
            claims[peer] = float(at)
    return claims


def winner(claims: dict[str, float], ignore: Collection[str] = ()) -> str | None:
    """The earliest claim (ties by peer id) of a claimer not in ``ignore``, or None."""
    counted = {p: t for p, t in claims.items() if p not in ignore}
    return min(counted, key=lambda p: (counted[p], p)) if counted else None


async def claim_stage(dht: DHTNode, validator: RSASignatureValidator, run_id: str, stage: int, peer_id: str,
                      ttl: float = CLAIM_TTL_S, settle: float = CLAIM_SETTLE_S, ignore: Collection[str] = ()) -> str:
    """Claim ``stage`` for ``peer_id`` unless someone else (not in ``ignore``) holds a fresh claim; returns the winner."""
    existing = await read_claims(dht, run_id, stage)
    others = {p: t for p, t in existing.items() if p != peer_id}
    first = winner(others, ignore)
    if first is not None:
        return first
    now = get_dht_time()
    await dht.store(claim_key(run_id, stage), {"peer_id": peer_id, "at": existing.get(peer_id, now)}, now + ttl,
                    subkey=owned_subkey(peer_id, validator))
    await asyncio.sleep(settle)
    return winner(await read_claims(dht, run_id, stage), ignore) or peer_id
