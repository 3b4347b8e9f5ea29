"""``node status``: join the DHT as a client, list the run's peers and ask each for its live status."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from gossip.rendezvous import list_peers_with_expiry
from node.status_service import fetch_status
from protocol.hivemind_transport import Transport


async def _collect(initial_peers: list[str], run_id: str, timeout: float, swarm_key: bytes | None) -> dict[str, Any]:
    p2p = await P2P.create(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht = await DHTNode.create(p2p=p2p, initial_peers=initial_peers, client_mode=True, record_validator=RSASignatureValidator())
    try:
        transport = Transport(p2p, swarm_key=swarm_key)
        records = await asyncio.wait_for(list_peers_with_expiry(dht, run_id), timeout=30)
        now = get_dht_time()
        rows = []

        async def one(peer: str) -> dict[str, Any] | None:
            try:
                return await asyncio.wait_for(fetch_status(transport, peer), timeout)
            except Exception:
                return None

        live = await asyncio.gather(*(one(p) for p in records))
        from node.daemon import RECORD_TTL_S

        for (peer, (rec, expiration)), st in zip(records.items(), live):
            rows.append({
                "peer_id": peer, "role": rec.role, "device": rec.device, "model": rec.model, "algorithm": rec.algorithm,
                "compression": rec.compression, "tokens_per_s": rec.tokens_per_s, "round": rec.round,
                "inner_step": rec.inner_step, "loss": rec.loss, "record_age_s": max(0.0, RECORD_TTL_S - (expiration - now)),
                "maddrs": rec.maddrs, "protocols": rec.protocols, "reachable": st is not None, "live": st,
            })
        return {"run_id": run_id, "time": time.time(), "peers": sorted(rows, key=lambda r: r["peer_id"])}
    finally:
        await dht.shutdown()
        await p2p.shutdown()


def collect_status(initial_peers: list[str], run_id: str, timeout: float = 5.0, swarm_key: bytes | None = None) -> dict[str, Any]:
    return asyncio.run(_collect(initial_peers, run_id, timeout, swarm_key))


def render_status(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {result['run_id']}: {len(result['peers'])} peers")
    for col in ("peer", "role", "device", "tok/s", "round", "step", "loss", "age"):
        table.add_column(col, justify="right" if col not in ("peer", "role", "device") else "left")
    for r in result["peers"]:
        table.add_row(r["peer_id"][-12:], r["role"], r["device"], f"{r['tokens_per_s']:.0f}", str(r["round"]),
                      str(r["inner_step"]), f"{r['loss']:.3f}", f"{r['record_age_s']:.1f}s")
    Console().print(table)
    if not result["peers"]:
        Console().print("No live peers: check --run-id and that the multiaddr is of a running node.")
