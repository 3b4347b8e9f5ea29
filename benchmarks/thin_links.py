"""Thin links: a swarm whose nodes each sit in their own network namespace behind a ``tc tbf`` limit.

    sudo python -m benchmarks.thin_links --rates 20,5 --codecs none,topk:64/4096+q2 --duration 120 \\
        --out runs/thin/report.json [--partition] [--nat]

``--nat`` runs each rate and codec twice on :mod:`benchmarks.nat_topology`: three peers that can all
dial each other ("direct"), and one public peer with two homes behind NAT ("relay": the homes reach
each other through the public peer's locomesh relay). It reports round time and bytes of each.

Topology: a hub namespace with a bridge; node i lives in namespace ``lmn<i>`` with address
10.201.0.<10+i>/24 on a veth pair whose both ends are shaped with ``tbf rate R mbit`` (upload and
download of R Mbit/s per node). netem is not used (not available everywhere), so links add no
latency. ``--partition`` also cuts one node's link for longer than the averaging deadline and
restores it, then checks that the node re-synced with the swarm. Needs root (``ip netns``, ``tc``).
Everything it creates is removed at the end, also on errors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import results_io

SUBNET = "10.201.0"
NS_HUB = "lmhub"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def ns_of(i: int) -> str:
    return f"lmn{i}"


def setup(n: int, rate_mbit: float) -> None:
    teardown(n)
    sh("ip", "netns", "add", NS_HUB)
    sh("ip", "netns", "exec", NS_HUB, "ip", "link", "add", "br0", "type", "bridge")
    sh("ip", "netns", "exec", NS_HUB, "ip", "link", "set", "br0", "up")
    for i in range(n):
        ns, a, b = ns_of(i), f"lmn{i}a", f"lmn{i}b"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        sh("ip", "link", "set", a, "netns", ns)
        sh("ip", "link", "set", b, "netns", NS_HUB)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", a)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", a, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", NS_HUB, "ip", "link", "set", b, "master", "br0")
        sh("ip", "netns", "exec", NS_HUB, "ip", "link", "set", b, "up")
        for where, dev in ((ns, a), (NS_HUB, b)):  # shape upload (node side) and download (hub side)
            sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
               "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "400ms")


def teardown(n: int) -> None:
    for i in range(n):
        sh("ip", "netns", "del", ns_of(i), check=False)
    sh("ip", "netns", "del", NS_HUB, check=False)


def set_link(i: int, up: bool) -> None:
    sh("ip", "netns", "exec", NS_HUB, "ip", "link", "set", f"lmn{i}b", "up" if up else "down")


def start(i: int, directory: Path, join_args: list[str], peers: list[str]) -> subprocess.Popen:
    d = directory / f"node{i}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "info.json").unlink(missing_ok=True)
    cmd = ["ip", "netns", "exec", ns_of(i), sys.executable, "-m", "node", "join", *join_args,
           "--listen", f"/ip4/{SUBNET}.{10 + i}/tcp/0", "--seed", str(i), "--checkpoint-dir", str(d),
           "--info-file", str(d / "info.json")]
    for p in peers:
        cmd += ["--initial-peers", p]
    return subprocess.Popen(cmd, stdout=open(d / "log.txt", "w"), stderr=subprocess.STDOUT, start_new_session=True)


def info(directory: Path, i: int) -> dict[str, Any]:
    try:
        return json.loads((directory / f"node{i}" / "info.json").read_text())
    except (OSError, ValueError):
        return {}


def run_case(n: int, rate: float, codec: str, duration: float, directory: Path, partition: bool, timeout: float) -> dict[str, Any]:
    setup(n, rate)
    procs: list[subprocess.Popen] = []
    events: list[dict[str, Any]] = []
    t0 = time.time()
    args = ["--model", "tiny", "--batch-size", "8", "--inner-steps", "30", "--threads", "1", "--eval-batches", "8",
            "--compression", codec, "--averaging-timeout", str(timeout)]
    try:
        procs.append(start(0, directory, args, []))
        deadline = time.time() + 120
        while not info(directory, 0).get("multiaddrs") and time.time() < deadline:
            time.sleep(0.5)
        boot = info(directory, 0)["multiaddrs"][0]
        for i in range(1, n):
            procs.append(start(i, directory, args, [boot]))
        victim = n - 1
        cut_at, cut_for = duration * 0.3, timeout * 2
        cut_done = False
        while time.time() - t0 < duration:
            if partition and not cut_done and time.time() - t0 >= cut_at:
                set_link(victim, False)
                events.append({"t": round(time.time() - t0, 1), "event": "link_down", "node": victim})
                time.sleep(cut_for)
                set_link(victim, True)
                events.append({"t": round(time.time() - t0, 1), "event": "link_up", "node": victim})
                cut_done = True
            time.sleep(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=90))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes.append(p.wait())
        teardown(n)
    nodes = []
    for i in range(n):
        inf = info(directory, i)
        rounds = inf.get("rounds", [])
        avg_bytes = inf.get("bytes_sent_by_kind", {}).get("average", 0)
        nodes.append({
            "node": i, "exit_code": codes[i], "outer_rounds": inf.get("outer_rounds", 0), "steps": inf.get("steps", 0),
            "val_loss": inf.get("val_loss"), "train_loss_first": inf.get("train_loss_first"), "train_loss_last": inf.get("train_loss_last"),
            "bytes_sent": inf.get("bytes_sent", 0), "average_bytes_per_round": avg_bytes / max(1, inf.get("outer_rounds", 0)),
            "round_s": [r["duration_s"] for r in rounds], "gather_s": [r["gather_s"] for r in rounds],
            "partial_rounds": sum(1 for r in rounds if r["failures"]),
            "events": [e["event"] for e in inf.get("events", [])],
        })
    all_rounds = [x for nd in nodes for x in nd["round_s"]]
    exchange = [r - g for nd in nodes for r, g in zip(nd["round_s"], nd["gather_s"])]
    result = {
        "rate_mbit": rate, "codec": codec, "nodes": n, "duration_s": duration, "partition": partition, "events": events,
        "round_s_median": statistics.median(all_rounds) if all_rounds else None,
        "round_s_max": max(all_rounds) if all_rounds else None,
        "exchange_s_median": statistics.median(exchange) if exchange else None,
        "outer_rounds_min": min(nd["outer_rounds"] for nd in nodes),
        "average_bytes_per_round": statistics.median(nd["average_bytes_per_round"] for nd in nodes),
        "val_loss": [nd["val_loss"] for nd in nodes],
        "per_node": nodes,
    }
    if partition:
        result["victim_rejoined"] = bool({"resynced", "caught_up"} & set(nodes[-1]["events"]))
    return result


def run_nat_case(rate: float, codec: str, duration: float, directory: Path, timeout: float, behind_nat: bool) -> dict[str, Any]:
    """Three ``tiny`` DiLoCo peers at ``rate`` Mbit/s each: all public, or one public and two behind NAT."""
    from benchmarks.nat_topology import NatTopology, NsNode

    args = ["--model", "tiny", "--batch-size", "8", "--inner-steps", "30", "--threads", "1", "--eval-batches", "8",
            "--compression", codec, "--averaging-timeout", str(timeout), "--run-id", "nat-bench", "--eval-every", "0"]
    tag = "bn" if behind_nat else "bd"
    with NatTopology(homes=2 if behind_nat else 0, public_hosts=1 if behind_nat else 3, tag=tag, rate_mbit=rate) as net:
        hosts = net.public + net.home
        nodes: list[NsNode] = []
        try:
            nodes.append(NsNode(net, hosts[0], directory, "node0", [*args, "--seed", "0"], []))
            started = nodes[0].wait(lambda i: i.get("state") == "training", 180, "startup")
            boot = next(a for a in started["multiaddrs"] if f"/ip4/{hosts[0].address}/" in a)
            for i, host in enumerate(hosts[1:], 1):
                nodes.append(NsNode(net, host, directory, f"node{i}", [*args, "--seed", str(i)], [boot]))
            time.sleep(duration)
        finally:
            codes = []
            for node in reversed(nodes):
                try:
                    codes.append(node.stop(timeout=90))
                except subprocess.TimeoutExpired:
                    node.kill()
                    codes.append(-9)
            codes.reverse()
    per_node = []
    for node, code in zip(nodes, codes):
        inf = node.info()
        full = [r for r in inf.get("rounds", []) if r.get("contributors") == len(nodes)]
        rounds = max(1, inf.get("outer_rounds", 0))
        per_node.append({
            "node": node.name, "exit_code": code, "reachability": inf.get("reachability"), "outer_rounds": inf.get("outer_rounds", 0),
            "full_rounds": len(full), "round_s": [r["duration_s"] for r in full], "exchange_s": [r.get("exchange_s", 0.0) for r in full],
            "average_bytes_sent_per_round": inf.get("bytes_sent_by_kind", {}).get("average", 0) / rounds,
            "bytes_sent_per_round": inf.get("bytes_sent", 0) / rounds,
            "relayed_bytes_per_round": sum(inf.get("bytes_relayed", {}).values()) / rounds,
            "val_loss": inf.get("val_loss"),
        })
    rounds_s = [x for n in per_node for x in n["round_s"]]
    exchange_s = [x for n in per_node for x in n["exchange_s"]]
    return {
        "topology": "relay" if behind_nat else "direct", "rate_mbit": rate, "codec": codec, "duration_s": duration,
        "round_s_median": statistics.median(rounds_s) if rounds_s else None,
        "exchange_s_median": statistics.median(exchange_s) if exchange_s else None,
        "full_rounds_min": min(n["full_rounds"] for n in per_node),
        "average_bytes_sent_per_node_per_round": statistics.median(n["average_bytes_sent_per_round"] for n in per_node),
        "public_peer_bytes_sent_per_round": per_node[0]["bytes_sent_per_round"],
        "per_node": per_node,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rates", default="20,5", help="Mbit/s per node, comma separated")
    parser.add_argument("--codecs", default="none", help="codec specs, comma separated")
    parser.add_argument("--duration", type=float, default=120)
    parser.add_argument("--timeout", type=float, default=30, help="--averaging-timeout of the nodes")
    parser.add_argument("--partition", action="store_true", help="also run a partition case at the first rate")
    parser.add_argument("--nat", action="store_true", help="compare direct peers with two homes behind NAT reached through a relay")
    parser.add_argument("--out", default="runs/thin/report.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("thin_links needs root for ip netns and tc; run it with sudo")
    meta = results_io.begin()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = []
    if args.nat:
        for rate in [float(r) for r in args.rates.split(",")]:
            for codec in args.codecs.split(","):
                for behind_nat in (False, True):
                    print(f"== {rate} Mbit/s, {codec}, {'relay' if behind_nat else 'direct'}", flush=True)
                    where = out.parent / f"nat-{'relay' if behind_nat else 'direct'}-r{rate}-{codec.replace('/', '_')}"
                    shutil.rmtree(where, ignore_errors=True)  # every run starts from fresh checkpoint folders
                    cases.append(run_nat_case(rate, codec, args.duration, where, args.timeout, behind_nat))
                    print(json.dumps({k: v for k, v in cases[-1].items() if k != "per_node"}), flush=True)
        results_io.write(out, {"nat_cases": cases}, meta)
        print(f"report: {out}")
        return
    for rate in [float(r) for r in args.rates.split(",")]:
        for codec in args.codecs.split(","):
            print(f"== {rate} Mbit/s, {codec}", flush=True)
            where = out.parent / f"r{rate}-{codec.replace('/', '_')}"
            shutil.rmtree(where, ignore_errors=True)
            cases.append(run_case(args.nodes, rate, codec, args.duration, where, False, args.timeout))
            print(json.dumps({k: v for k, v in cases[-1].items() if k != "per_node"}), flush=True)
    if args.partition:
        rate = float(args.rates.split(",")[0])
        print(f"== partition at {rate} Mbit/s", flush=True)
        shutil.rmtree(out.parent / "partition", ignore_errors=True)
        cases.append(run_case(args.nodes, rate, "none", args.duration, out.parent / "partition", True, args.timeout))
        print(json.dumps({k: v for k, v in cases[-1].items() if k != "per_node"}), flush=True)
    results_io.write(out, {"cases": cases}, meta)
    print(f"report: {out}")


if __name__ == "__main__":
    main()
