"""Does ``--max-upload-mbit`` hold on the wire while training goes on?

Two DiLoCo nodes, each in its own network namespace on a bridge (``benchmarks.nat_topology``, no NAT):
``free`` starts the run uncapped, ``capped`` joins it with ``--max-upload-mbit R``. Once they have
averaged a first round together, the bytes the capped node's namespace interface sends are sampled
for ``--seconds`` (everything: locomesh streams, the DHT's traffic in p2pd, TCP/IP headers, ACKs of
what it receives), along with the node's own locomesh byte counter, the rounds completed and the loss.

    sudo python -m benchmarks.bandwidth_cap --seconds 60 --cap-mbit 2 --out benchmarks/results/bandwidth_cap.json

Without a cap (``--cap-mbit 0``) the same run shows what the node would send: the cap must be the
binding limit for the measurement to mean anything. Needs root (``ip netns``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import results_io
from benchmarks.nat_topology import NatTopology, NsNode, missing_tools

try:
    from hivemind.p2p import P2P, PeerID
except ImportError:  # the benchmark's CLI help works without hivemind
    P2P = PeerID = None  # type: ignore[assignment,misc]

# both nodes wait for each other (--min-peers 2) and start from the same state at round 0: a joiner's first
# round can split a pair of nodes (it may average with a round its peer already closed alone), and when the
# uncapped node then downloads the capped one's state, the download crawls at the cap while the capped node
# runs rounds alone, faster than the download: the two never meet again (seen 1 in 4 runs of the test)
MODEL_ARGS = ["--model", "micro", "--batch-size", "8", "--inner-steps", "10", "--threads", "1", "--warmup-steps", "5",
              "--eval-batches", "2", "--eval-every", "0", "--averaging-timeout", "20", "--run-id", "cap", "--min-peers", "2"]


def tx_rx_bytes(netns: str, dev: str = "wan") -> tuple[int, int]:
    """(bytes sent, bytes received) so far by ``dev`` in namespace ``netns``."""
    out = subprocess.run(["ip", "-n", netns, "-j", "-s", "link", "show", "dev", dev], capture_output=True, text=True, check=True)
    stats = json.loads(out.stdout)[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def identities(workdir: Path) -> tuple[Path, Path]:
    """Two identity files, the one of the smaller peer id first (the uncapped node's)."""
    keys = []
    for name in ("a", "b"):
        path = workdir / f"{name}.key"
        P2P.generate_identity(str(path))
        keys.append((PeerID.from_identity(path.read_bytes()).to_base58(), path))
    keys.sort(key=lambda k: k[0])
    return keys[0][1], keys[1][1]


def _full_rounds(info: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in info.get("rounds", []) if r.get("contributors") == 2 and r.get("in_sync")]


def peak_mbit(samples: list[dict[str, Any]], seconds: int) -> float:
    """The highest rate the interface sent at over any ``seconds`` consecutive samples (one a second)."""
    points = [{"t": 0.0, "tx_bytes": 0}, *samples]
    rates = [(points[i + seconds]["tx_bytes"] - points[i]["tx_bytes"]) * 8 / (points[i + seconds]["t"] - points[i]["t"]) / 1e6
             for i in range(len(points) - seconds)]
    return round(max(rates, default=math.nan), 4)


def measure(workdir: Path, cap_mbit: float, seconds: float, tag: str = "cap", min_rounds: int = 0,
            max_seconds: float = 600.0) -> dict[str, Any]:
    """Run the two nodes, sample the capped node's traffic for ``seconds`` after their first common
    round (longer until ``min_rounds`` more rounds completed, ``max_seconds`` at most), and return the
    measurement (rates in Mbit/s, 10^6 bits per second)."""
    began = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    free_key, capped_key = identities(workdir)
    with NatTopology(homes=0, public_hosts=2, tag=tag) as net:
        nodes: list[NsNode] = []
        try:
            free = NsNode(net, net.public[0], workdir, "free", [*MODEL_ARGS, "--seed", "0", "--identity", str(free_key)], [])
            nodes.append(free)
            info = free.wait(lambda i: bool(i.get("multiaddrs")), 120, "startup")  # it waits for --min-peers 2 from here
            boot = next(a for a in info["multiaddrs"] if f"/ip4/{net.public[0].address}/" in a)
            extra = ["--max-upload-mbit", str(cap_mbit)] if cap_mbit > 0 else []
            capped = NsNode(net, net.public[1], workdir, "capped", [*MODEL_ARGS, "--seed", "1", "--identity", str(capped_key), *extra],
                            [boot])
            nodes.append(capped)
            capped.wait(lambda i: len(_full_rounds(i)) >= 1, 180, "a first round with the other node")
            ns = net.public[1].netns
            ready_s = time.monotonic() - began
            start_info = capped.info()
            done = len(_full_rounds(start_info))
            t0, (tx0, rx0) = time.monotonic(), tx_rx_bytes(ns)
            samples = []
            while time.monotonic() - t0 < seconds or (len(_full_rounds(capped.info())) < done + min_rounds
                                                     and time.monotonic() - t0 < max_seconds):
                time.sleep(1.0)
                if capped.process.poll() is not None or free.process.poll() is not None:
                    raise AssertionError(f"a node exited during the measurement:\n{capped.log()[-2000:]}\n{free.log()[-2000:]}")
                tx, rx = tx_rx_bytes(ns)
                samples.append({"t": round(time.monotonic() - t0, 2), "tx_bytes": tx - tx0, "rx_bytes": rx - rx0})
            t1, (tx1, rx1) = time.monotonic(), tx_rx_bytes(ns)
            end_info, free_info = capped.info(), free.info()
            logs = {node.name: node.log()[-2500:] for node in nodes}
        finally:  # a clean stop is not what this measures
            for node in nodes:
                node.kill()
    window = t1 - t0
    rounds = [r for r in _full_rounds(end_info) if r not in _full_rounds(start_info)]
    own = end_info.get("bytes_sent", 0) - start_info.get("bytes_sent", 0)  # streams are counted when they close
    return {
        "cap_mbit": cap_mbit,
        "ready_s": round(ready_s, 1),  # from building the namespaces to the first common round
        "window_s": round(window, 2),
        "wire_tx_mbit": round((tx1 - tx0) * 8 / window / 1e6, 4),
        "wire_rx_mbit": round((rx1 - rx0) * 8 / window / 1e6, 4),
        "locomesh_sent_mbit": round(own * 8 / window / 1e6, 4),
        # the link idles while the node computes: the cap shows in the rate of its busiest seconds
        "peak_tx_mbit": {f"{w}s": peak_mbit(samples, w) for w in (1, 3, 10)},
        "wire_tx_bytes": tx1 - tx0,
        "locomesh_sent_bytes": own,
        "rounds_in_window": len(rounds),
        "round_durations_s": [round(r.get("duration_s", math.nan), 2) for r in rounds],
        "rounds_total": len(_full_rounds(end_info)),
        "train_loss_first": end_info.get("train_loss_first"),
        "train_loss_last": end_info.get("train_loss_last"),
        "free_train_loss_first": free_info.get("train_loss_first"),  # the bootstrap node's, from scratch
        "free_rounds_total": len(_full_rounds(free_info)),
        "samples": samples,
        "logs": logs,  # their tails, for a failed check
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--cap-mbit", type=float, nargs="+", default=[2.0], help="one run per value; 0: uncapped")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/bandwidth_cap.json"))
    args = parser.parse_args()
    if missing_tools() is not None:
        sys.exit(f"bandwidth_cap {missing_tools()}; run it with sudo")
    meta = results_io.begin()
    runs = []
    for cap in args.cap_mbit:
        with tempfile.TemporaryDirectory() as d:
            run = measure(Path(d), cap, args.seconds, tag=f"bw{int(cap * 10)}")
        run.pop("logs")
        print(json.dumps({k: v for k, v in run.items() if k != "samples"}), flush=True)
        runs.append(run)
    report = {"commit": meta.git_commit, "command": meta.command, "runs": runs}
    results_io.write(args.out, report, meta)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
