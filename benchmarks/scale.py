"""Scale benchmark: what one peer pays per DiLoCo round as the swarm grows.

    python -m benchmarks.scale --peers 8,16,32,64 [--params P] [--codec C] [--rounds R] [--max-group-size G] --out PATH.json

Real lightweight peers on loopback, all in this process: each has its own p2pd, hivemind DHT node,
locomesh transport, ``RoundExchange`` and ``DiLoCoAverager`` (the daemon's round logic: DHT
rendezvous, reduce-scatter or all-gather, aggregation, outer step), and a synthetic pseudo-gradient
of P parameters instead of a model. Per swarm size the report holds bytes sent and received per peer
per round (average protocol, measured by the transport), round time (median and p95 over peers and
rounds, the first round left out), DHT requests per peer per round (every find and store request
the peer's DHT node sent, counted on its protocol object) and resident memory per peer (this
process and its p2pd children, divided by the peers). A swarm larger than ``--max-group-size`` (32, as
``node join``) averages in bounded groups (``gossip.groups``); then the report also holds the groups
per round and the replicas' spread after each round: the largest distance of a peer's φ from the
swarm's mean φ, in units of one peer's update (the synthetic updates are independent noise, the
worst case for agreement: real pseudo-gradients share most of their direction).

``simulated`` extrapolates to 256, 1000 and 4000 peers with the model in ``benchmarks.scale_model``
(docs/benchmarks.md), calibrated on the measured runs, for two links: 20 Mbit/s with 50 ms RTT and
1 Gbit/s with 10 ms RTT. Loopback round times on a 2-core machine measure CPU, not links: they only
calibrate the per-round fixed cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from benchmarks import results_io
from benchmarks.scale_model import LINKS, SIM_PEERS, calibrate, simulate, synthetic_shapes
from gossip.diloco import DiLoCoAverager
from gossip.exchange import RoundExchange
from gossip.outer import NesterovOuter
from gossip.reduce_scatter import wire_partition
from gossip.rendezvous import publish_peer
from protocol.hivemind_transport import Transport
from protocol.peer_identity import bind, identified_p2p
from protocol.records import PEER_RECORD_TTL_S, PeerRecord

RUN = "scale-bench"


@dataclass
class Peer:
    p2p: P2P
    dht: DHTNode
    validator: RSASignatureValidator
    exchange: RoundExchange
    averager: DiLoCoAverager
    phi: list[torch.Tensor]
    counts: dict[str, int] = field(default_factory=lambda: {"sent": 0, "received": 0, "dht": 0})

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()


def count_dht_requests(dht: DHTNode, counts: dict[str, int]) -> None:
    """Count every find and store request this DHT node sends (hivemind's own lookups included)."""
    protocol = dht.protocol
    for name in ("call_find", "call_store", "call_ping"):
        original = getattr(protocol, name)

        async def counted(*args, _original=original, **kwargs):
            counts["dht"] += 1
            return await _original(*args, **kwargs)

        setattr(protocol, name, counted)


async def make_peer(initial: list[str], shapes: list[tuple[int, ...]], codec: str, timeout: float, max_group_size: int,
                    data_channel: bool = False) -> Peer:
    """A lightweight peer on loopback (``data_channel``: bulk streams over ``protocol.datachannel``)."""
    p2p, validator = await identified_p2p(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht = await DHTNode.create(p2p=p2p, initial_peers=initial, record_validator=validator)
    bind(dht, validator)
    counts = {"sent": 0, "received": 0, "dht": 0}

    def on_bytes(protocol: str, direction: str, nbytes: int, path: str = "direct") -> None:
        counts[direction] += nbytes

    transport = Transport(p2p, on_bytes=on_bytes, identity=validator.identity)
    if data_channel:
        await transport.enable_data_channel("127.0.0.1")
    partition = wire_partition(codec, shapes)
    exchange = RoundExchange(transport, RUN, codec, partition.shapes(shapes), serve_timeout=2 * timeout)
    await exchange.start()
    peer_id = p2p.peer_id.to_base58()
    averager = DiLoCoAverager(dht, validator, exchange, RUN, peer_id, NesterovOuter(lr=1.0, momentum=0.0),
                              gather_timeout=timeout, fetch_timeout=timeout, partition=partition, max_group_size=max_group_size,
                              weight_codec="none" if codec == "none" else "fp16")
    count_dht_requests(dht, counts)
    return Peer(p2p, dht, validator, exchange, averager, [torch.zeros(s) for s in shapes], counts)


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def replica_spread(phis: list[list[torch.Tensor]], update_norm: float) -> float:
    """max_i ‖φ_i − φ̄‖ / ‖Δ‖: how far the replicas are from agreeing, in units of one peer's update."""
    mean = [torch.stack(ts).mean(0) for ts in zip(*phis)]
    worst = max(sum(float((p - m).pow(2).sum()) for p, m in zip(phi, mean)) ** 0.5 for phi in phis)
    return worst / update_norm


async def run_size(n: int, params: int, codec: str, rounds: int, timeout: float, max_group_size: int = 32) -> dict:
    shapes = synthetic_shapes(params)
    peers: list[Peer] = []
    try:
        for _ in range(n):
            initial = [str(a) for a in await peers[0].p2p.get_visible_maddrs()] if peers else []
            peers.append(await make_peer(initial, shapes, codec, timeout, max_group_size))
        for peer in peers:  # everyone learns of its neighbours, as heartbeats do in a running swarm
            await peer.dht.find_nearest_nodes([peer.dht.node_id])
        g = torch.Generator().manual_seed(0)
        per_round: list[dict] = []
        for r in range(rounds):
            await asyncio.gather(*(publish_peer(p.dht, p.validator, RUN, PeerRecord(peer_id=p.peer_id, round=r), PEER_RECORD_TTL_S) for p in peers))
            marks = [dict(p.counts) for p in peers]
            deltas = [[torch.randn(s, generator=g) * 0.01 for s in shapes] for _ in peers]

            async def one(peer: Peer, delta: list[torch.Tensor]):
                theta = [p - d for p, d in zip(peer.phi, delta)]
                return await peer.averager.run_round(r, peer.phi, theta, samples=16)

            results = await asyncio.gather(*(one(p, d) for p, d in zip(peers, deltas)))
            per_round.append({
                "round": r,
                "duration_s": [res.duration_s for res in results],
                "contributors": [len(res.contributors) for res in results],
                "schemes": sorted({"reduce-scatter" if res.reduce_scatter else "all-gather" for res in results}),
                "sent": [p.counts["sent"] - m["sent"] for p, m in zip(peers, marks)],
                "received": [p.counts["received"] - m["received"] for p, m in zip(peers, marks)],
                "dht": [p.counts["dht"] - m["dht"] for p, m in zip(peers, marks)],
                "groups": sorted({res.groups for res in results}),
                "complete": all(len(res.contributors) == len(res.group) for res in results),
                "spread": replica_spread([p.phi for p in peers], statistics.mean(sum(float(t.pow(2).sum()) for t in d) ** 0.5 for d in deltas)),
            })
        pids = [os.getpid()] + _children(os.getpid())
        memory = rss_mb(pids) / n
    finally:
        for peer in peers:
            await peer.dht.shutdown()
            await peer.p2p.shutdown()
    steady = per_round[1:] or per_round
    durations = sorted(d for row in steady for d in row["duration_s"])
    payload = params * 4 if codec == "none" else None
    return {
        "peers": n, "params": params, "codec": codec, "payload_bytes": payload, "rounds": rounds, "max_group_size": max_group_size,
        "groups": sorted({g for row in per_round for g in row["groups"]}),
        "spread_after_each_round": [row["spread"] for row in per_round],
        "schemes": sorted({s for row in per_round for s in row["schemes"]}),
        "full_rounds": sum(row["complete"] for row in steady),  # every member averaged with its whole group
        "group_sizes": sorted({c for row in per_round for c in row["contributors"]}),
        "bytes_sent_per_node_per_round": statistics.mean(x for row in steady for x in row["sent"]),
        "bytes_sent_per_node_per_round_max": max(x for row in steady for x in row["sent"]),
        "bytes_received_per_node_per_round": statistics.mean(x for row in steady for x in row["received"]),
        "round_s_median": statistics.median(durations),
        "round_s_p95": durations[min(len(durations) - 1, int(0.95 * len(durations)))],
        "dht_requests_per_node_per_round": statistics.mean(x for row in steady for x in row["dht"]),
        "rss_mb_per_peer": memory,
        "per_round": per_round,
    }


def write_report(out: Path, runs: list[dict], args: argparse.Namespace, argv: list[str] | None,
                 meta: results_io.RunMeta) -> dict:
    """The report of the sizes measured so far, with the model calibrated on them (written atomically)."""
    report = {
        "runs": runs,
        **simulated_rows(runs, args.max_group_size),
        "environment": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "command": "python -m benchmarks.scale " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    results_io.write(out, report, meta)
    return report


def simulated_rows(runs: list[dict], max_group_size: int) -> dict[str, Any]:
    """The cost model calibrated on ``runs`` and its rows: bounded groups, and one group."""
    model, payload = calibrate(runs), runs[0]["params"] * 4 if runs else 0
    return {"model": model,
            "simulated": [simulate(model, n, payload, link, max_group_size=max_group_size) for n in SIM_PEERS for link in LINKS],
            "simulated_one_group": [simulate(model, n, payload, link) for n in SIM_PEERS for link in LINKS]}


def resimulate(path: Path, max_group_size: int) -> dict:
    """Recompute a report's model and simulated rows from its measured runs with this build's cost model
    (nothing is measured again); the file records which build simulated them (``resimulated``)."""
    report = json.loads(path.read_text())
    report.update(simulated_rows(report["runs"], max_group_size))
    commit, dirty = results_io.git_state()
    report["resimulated"] = {"commit": commit, "dirty": dirty, "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                             "note": "simulated rows recomputed from the measured runs with this build's benchmarks/scale_model.py"}
    results_io.write_json(path, report)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="8,16,32,64", help="comma separated swarm sizes")
    ap.add_argument("--params", type=int, default=1_000_000, help="parameters of the synthetic pseudo-gradient")
    ap.add_argument("--codec", default="none")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0, help="rendezvous and fetch timeout per round")
    ap.add_argument("--max-group-size", type=int, default=32, help="a larger swarm averages in random groups of about this many")
    ap.add_argument("--out", help="JSON report to write")
    ap.add_argument("--resimulate", type=Path, metavar="REPORT",
                    help="only recompute REPORT's simulated rows from its measured runs with this build's model")
    args = ap.parse_args(argv)
    if args.resimulate:
        resimulate(args.resimulate, args.max_group_size)
        print(f"resimulated: {args.resimulate}")
        return 0
    if not args.out:
        ap.error("--out is required")
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.scale", *argv])
    runs: list[dict] = []
    out = Path(args.out)
    for n in [int(x) for x in args.peers.split(",")]:
        started = time.monotonic()
        run = asyncio.run(run_size(n, args.params, args.codec, args.rounds, args.timeout, args.max_group_size))
        runs.append(run)
        write_report(out, runs, args, argv, meta)  # what was measured survives a later size that fails
        payload = run["payload_bytes"] or 1
        print(f"{n:5d} peers: sent {run['bytes_sent_per_node_per_round'] / payload:.2f}x payload/round "
              f"(max {run['bytes_sent_per_node_per_round_max'] / payload:.2f}x), round {run['round_s_median']:.2f}s "
              f"(p95 {run['round_s_p95']:.2f}s), {run['dht_requests_per_node_per_round']:.1f} DHT requests/round, "
              f"{run['rss_mb_per_peer']:.0f} MB/peer, {run['full_rounds']} full rounds, groups {run['groups']} of {run['group_sizes']}, "
              f"spread {run['spread_after_each_round'][-1]:.3f} [{time.monotonic() - started:.0f}s]", flush=True)
    report = write_report(out, runs, args, argv, meta)
    for row in report["simulated"]:
        print(f"simulated {row['peers']:5d} peers (groups of {row['group']:.0f}), {row['link']}: sent {row['bytes_sent_per_node_per_round'] / (args.params * 4):.2f}x payload, "
              f"round {row['round_s_median']:.2f}s, {row['dht_requests_per_node_per_round']:.1f} DHT requests")
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
