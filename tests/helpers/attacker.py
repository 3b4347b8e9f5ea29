"""An attacking peer for live tests: joins a run's DHT and stores forged records until stopped.

Run as ``python -m tests.helpers.attacker --initial-peers MADDR --run-id RUN --report FILE``. Every
second it reads the run's members and round R, then stores (each kind can be switched off):

- ``impersonate``: a PeerRecord "of" every honest member announcing round R + ``--ahead``: under a
  subkey without owner (one-year expiration) and under the member's id with the attacker's key;
- ``invent``: ``--sybils`` members that do not exist, announcing round R: unowned subkeys of made-up
  ids (one-year expiration) and records signed by fresh keys no daemon runs (refreshed, TTL 8 s);
- ``ahead``: its own, validly signed record announcing round R + ``--ahead`` (it serves nothing);
- ``claim`` (pipelines, off unless asked for): a validly signed claim on each of ``--stages`` stages
  with time 0, the earliest possible, refreshed every pass; it never rebuilds a stage;
- ``serve`` (pipelines, off unless asked for): for each of ``--stages`` stages, a server record
  signed by a fresh key no daemon runs, so that no stage ever looks lost (refreshed, TTL 8 s).

Its DHT node validates nothing, so its stores reach the honest nodes as written. The report (JSON,
rewritten atomically each pass) names the attacker, the invented ids and the members it impersonated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import multihash
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from gossip.rendezvous import list_peers
from protocol.peer_identity import OwnedRecordValidator, identified_p2p
from protocol.records import PeerRecord, peers_key
from swarm.claims import CLAIM_TTL_S, claim_key

YEAR = 365 * 86400.0
KINDS = ("impersonate", "invent", "ahead")
PIPELINE_KINDS = ("claim", "serve")


def made_up_id(rng: random.Random) -> str:
    return PeerID(multihash.encode(rng.randbytes(32), multihash.coerce_code("sha2-256"))).to_base58()


async def _store(dht: DHTNode, key: str, record: PeerRecord, expiration: float, subkey: bytes,
                 signer: OwnedRecordValidator | None) -> None:
    dht.protocol.record_validator = signer  # signs when its owner tag is in the subkey; None: stored as is
    try:
        await dht.store(key, record.to_value(), expiration, subkey=subkey)
    finally:
        dht.protocol.record_validator = None


async def _join(initial_peers: list[str], timeout: float = 120.0) -> tuple[P2P, OwnedRecordValidator, DHTNode]:
    """Join the DHT, retrying while the initial peers are not up yet (a test may start everyone at once)."""
    deadline = time.monotonic() + timeout
    while True:
        p2p = None
        try:
            p2p, me = await identified_p2p(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            return p2p, me, await DHTNode.create(p2p=p2p, initial_peers=initial_peers, record_validator=None)
        except Exception:
            if p2p is not None:
                await p2p.shutdown()
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def attack(initial_peers: list[str], run_id: str, report: Path, kinds: set[str], sybils: int, ahead: int,
                 stages: int = 0) -> None:
    p2p, me, dht = await _join(initial_peers)
    rng = random.Random(7)
    fake_ids = [made_up_id(rng) for _ in range(sybils)]
    fake_keys = [OwnedRecordValidator() for _ in range(sybils)]
    fake_servers = [OwnedRecordValidator() for _ in range(stages if "serve" in kinds else 0)]
    key = peers_key(run_id)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    victims: set[str] = set()
    passes = 0
    try:
        while not stop.is_set():
            invented = fake_ids + [k.peer_id for k in fake_keys + fake_servers]
            peers = {p: r for p, r in (await list_peers(dht, run_id)).items() if p != me.peer_id and p not in invented}
            r = max((rec.round for rec in peers.values()), default=0)
            now = get_dht_time()
            if "impersonate" in kinds:
                for victim in peers:
                    victims.add(victim)
                    forged = PeerRecord(peer_id=victim, round=r + ahead, maddrs=[], tokens_per_s=1e30)
                    await _store(dht, key, forged, now + YEAR, victim.encode(), None)
                    await _store(dht, key, forged, now + 8, victim.encode() + me.local_public_key, me)
            if "invent" in kinds:
                for fake in fake_ids:
                    await _store(dht, key, PeerRecord(peer_id=fake, round=r), now + YEAR, fake.encode(), None)
                for signer in fake_keys:
                    await _store(dht, key, PeerRecord(peer_id=signer.peer_id, round=r), now + 8, signer.owned_subkey(), signer)
            if "ahead" in kinds:
                own = PeerRecord(peer_id=me.peer_id, round=r + ahead, tokens_per_s=1e30)
                await _store(dht, key, own, now + 8, me.owned_subkey(), me)
            if "claim" in kinds:
                for stage in range(stages):
                    dht.protocol.record_validator = me
                    try:
                        await dht.store(claim_key(run_id, stage), {"peer_id": me.peer_id, "at": 0.0}, now + CLAIM_TTL_S,
                                        subkey=me.owned_subkey())
                    finally:
                        dht.protocol.record_validator = None
            for stage, signer in enumerate(fake_servers):
                server = PeerRecord(peer_id=signer.peer_id, role="stage", stage=stage, round=r, tokens_per_s=1e3)
                await _store(dht, key, server, now + 8, signer.owned_subkey(), signer)
            passes += 1
            tmp = report.with_suffix(".tmp")
            tmp.write_text(json.dumps({"peer_id": me.peer_id, "invented": invented, "victims": sorted(victims),
                                       "round": r, "passes": passes}))
            os.replace(tmp, report)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        await dht.shutdown()
        await p2p.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--run-id", default="locomesh-demo")
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--attacks", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS + PIPELINE_KINDS)}")
    parser.add_argument("--stages", type=int, default=0, help="with claim: the pipeline's stage count")
    parser.add_argument("--sybils", type=int, default=3)
    parser.add_argument("--ahead", type=int, default=1000)
    args = parser.parse_args()
    kinds = set(args.attacks.split(","))
    known = set(KINDS + PIPELINE_KINDS)
    if not kinds <= known:
        parser.error(f"--attacks: unknown {sorted(kinds - known)}; known: {', '.join(sorted(known))}")
    if kinds & set(PIPELINE_KINDS) and args.stages < 1:
        parser.error("--attacks claim and serve need --stages")
    asyncio.run(attack(args.initial_peers, args.run_id, args.report, kinds, args.sybils, args.ahead, args.stages))


if __name__ == "__main__":
    main()
