"""The wire at model sizes: one dense round between real peers, against the floors it runs on.

    python -m benchmarks.wire --params 25e6,100e6 --peers 2,4 [--dtypes fp32,bf16] [--rounds 4] --out PATH.json
    python -m benchmarks.wire --plan '25e6:2,4,8 100e6:2,4 250e6:2' --out benchmarks/results/wire.json

In one invocation and one results file, for each size (fp32 parameters) and peer count:

- ``tcp``: the raw floor. N processes on loopback each send the payload to each other over plain TCP
  sockets (an all-gather's bytes: (N − 1) × payload out and in per process) and time it.
- ``hivemind``: hivemind's ``DecentralizedAverager`` (its own p2pd, DHT matchmaking and butterfly
  all-reduce) averaging one tensor of the same size, one step per round, N processes.
- ``locomesh-libp2p``: the same with every stream through p2pd (as peers that cannot reach each
  other's data channel, ``protocol.datachannel``, exchange).
- ``locomesh``: a locomesh DiLoCo round (``gossip.diloco.DiLoCoAverager``: DHT rendezvous, the
  exchange, reduce-scatter from three peers, aggregation, the outer step) with a synthetic
  pseudo-gradient, one process per peer, each with its own p2pd and DHT node, codec ``none`` (fp32)
  or ``bf16``; bulk streams over the data channel.

Per row: the round time (median over peers and steady rounds; the first round is left out), the
payload's MB/s (bytes a peer sent and received in the round ÷ round time), whether every steady round
had every peer (``complete``), CPU seconds per peer per round (the Python process and its p2pd), and
``transient_mb``: the peak resident memory of a peer during a round beyond what it held before (its
model state: φ and θ), its p2pd included. Peaks are reset before each round (``/proc/PID/clear_refs``).
That misses what a process keeps between rounds (the wire parts it still serves, the heap malloc keeps),
so ``held_mb`` is the peak of a steady round beyond the resident memory before the first round (the
process, φ and θ, p2pd): for locomesh it includes the outer momentum (1 × the fp32 payload), which the
first round creates. ``minor_faults`` (``fresh_mb``: × 4 KiB) counts a steady round's first touches of fresh
memory in the peer and its children: a buffer the heap did not reuse costs a page fault per 4 KiB, which
on a virtual machine can cost as much as the copy that fills it.
Peers are processes, so the numbers include everything a daemon pays, on a machine where the
peers share its cores: on a 2-core machine the N peers and their p2pd compete for CPU (and for memory
bandwidth), so from 4 peers on the round time is mostly the sum of the peers' CPU seconds over the
cores. Each peer's torch gets cores ÷ N threads (``OMP_NUM_THREADS``, ``threads_per_peer``), as a
daemon alone on its machine gets all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import results_io

RUN = "wire-bench"  # hivemind's prefix; locomesh peers use benchmarks.scale.RUN
CODECS = {"fp32": "none", "bf16": "bf16"}


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_and_faults(pid: int) -> tuple[float, int]:
    """CPU seconds and minor page faults of ``pid`` from one read of /proc/PID/stat ((0, 0) for a gone process).
    A minor fault is a first touch of fresh memory: a buffer the heap did not reuse."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def _totals(pids: list[int]) -> tuple[float, int]:
    """CPU seconds and minor page faults summed over ``pids``."""
    both = [_cpu_and_faults(p) for p in pids]
    return sum(c for c, _ in both), sum(f for _, f in both)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (p2pd; hivemind's DHT and averager processes and their p2pd)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


class Meter:
    """Resident memory and CPU of this process and its children (p2pd), per round."""

    def __init__(self) -> None:
        self.pids = [os.getpid()] + _descendants(os.getpid())
        self.baseline: int | None = None  # resident kB before the first round: the process, φ (and θ), p2pd

    def start(self) -> None:
        for pid in self.pids:
            try:
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
            except OSError:
                pass
        self.rss = sum(_status_kb(p, "VmRSS") for p in self.pids)
        if self.baseline is None:
            self.baseline = self.rss
        self.cpu, self.faults = _totals(self.pids)

    def stop(self) -> dict[str, float]:
        peak = sum(max(_status_kb(p, "VmHWM"), _status_kb(p, "VmRSS")) for p in self.pids)
        cpu, faults = _totals(self.pids)
        return {"transient_mb": (peak - self.rss) / 1024, "held_mb": (peak - (self.baseline or 0)) / 1024, "rss_mb": peak / 1024,
                "cpu_s": cpu - self.cpu, "minor_faults": faults - self.faults}


# --- raw TCP floor -------------------------------------------------------------------------------

def _tcp_peer(rank: int, n: int, nbytes: int, ports: Any, barrier: Any, out: Any, rounds: int) -> None:
    """Send ``nbytes`` to every other peer and receive as much from each, over plain sockets."""
    server = socket.create_server(("127.0.0.1", 0))
    ports[rank] = server.getsockname()[1]
    barrier.wait()
    conns: dict[int, socket.socket] = {}
    accepted = threading.Thread(target=lambda: [conns.__setitem__(-1 - i, server.accept()[0]) for i in range(rank)])
    accepted.start()
    for other in range(rank + 1, n):
        conns[other] = socket.create_connection(("127.0.0.1", ports[other]))
    accepted.join()
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20) + bytearray(nbytes % (1 << 20)))
    sink = bytearray(1 << 22)

    def send(s: socket.socket) -> None:
        s.sendall(data)

    def receive(s: socket.socket) -> None:
        got = 0
        while got < nbytes:
            k = s.recv_into(sink, min(len(sink), nbytes - got))
            if not k:
                raise ConnectionError("peer closed early")
            got += k

    meter = Meter()
    for _ in range(rounds):
        barrier.wait()
        meter.start()
        started = time.perf_counter()
        threads = [threading.Thread(target=f, args=(s,)) for s in conns.values() for f in (send, receive)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out.put({"rank": rank, "round_s": time.perf_counter() - started, "moved": 2 * nbytes * (n - 1), "complete": True,
                 **meter.stop()})
    for s in conns.values():
        s.close()


# --- hivemind's averager -------------------------------------------------------------------------

def _hivemind_peer(rank: int, n: int, numel: int, dtype: str, addrs: Any, barrier: Any, out: Any, rounds: int) -> None:
    import hivemind
    import torch
    from hivemind.compression import Float16Compression, NoCompression

    mp.set_start_method("fork", force=True)  # hivemind forks its DHT and averager processes (this one was spawned)
    initial = list(addrs[0]) if rank else []
    dht = hivemind.DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    if rank == 0:
        addrs[0] = [str(a) for a in dht.get_visible_maddrs()]
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    averager = hivemind.averaging.DecentralizedAverager(
        [tensor], dht, prefix=RUN, target_group_size=n, min_group_size=n, start=True,
        compression=NoCompression() if dtype == "fp32" else Float16Compression())
    barrier.wait()
    meter = Meter()
    for _ in range(rounds):
        barrier.wait()
        meter.start()
        started = time.perf_counter()
        group = averager.step(timeout=300)
        out.put({"rank": rank, "round_s": time.perf_counter() - started, "complete": group is not None and len(group) == n,
                 "moved": 4 * numel * (4 if dtype == "fp32" else 2) * (n - 1) // n, **meter.stop()})
    averager.shutdown()
    dht.shutdown()


# --- locomesh's round ----------------------------------------------------------------------------

def _locomesh_peer(rank: int, n: int, numel: int, dtype: str, addrs: Any, barrier: Any, out: Any, rounds: int,
                   data_channel: bool = True) -> None:
    asyncio.run(_locomesh_rounds(rank, n, numel, dtype, addrs, barrier, out, rounds, data_channel))


def _locomesh_libp2p_peer(rank: int, n: int, numel: int, dtype: str, addrs: Any, barrier: Any, out: Any, rounds: int) -> None:
    asyncio.run(_locomesh_rounds(rank, n, numel, dtype, addrs, barrier, out, rounds, False))


async def _locomesh_rounds(rank: int, n: int, numel: int, dtype: str, addrs: Any, barrier: Any, out: Any, rounds: int,
                           data_channel: bool) -> None:
    import torch

    from benchmarks.scale import RUN as LOCOMESH_RUN
    from benchmarks.scale import make_peer
    from benchmarks.scale_model import synthetic_shapes
    from gossip.rendezvous import publish_peer
    from compression.memory import tune_allocator
    from protocol.records import PEER_RECORD_TTL_S, PeerRecord

    tune_allocator()  # as node join does
    shapes = synthetic_shapes(numel)
    initial = list(addrs[0]) if rank else []
    peer = await make_peer(initial, shapes, CODECS[dtype], 120.0, 32, data_channel=data_channel)
    if rank == 0:
        addrs[0] = [str(a) for a in await peer.p2p.get_visible_maddrs()]
    wait = lambda: asyncio.to_thread(barrier.wait)  # noqa: E731
    await wait()
    await peer.dht.find_nearest_nodes([peer.dht.node_id])
    g = torch.Generator().manual_seed(rank)
    meter = Meter()
    current = [0]

    async def heartbeat() -> None:  # as the daemon's: the record says which round this peer is in, and expires
        while True:
            await publish_peer(peer.dht, peer.validator, LOCOMESH_RUN, PeerRecord(peer_id=peer.peer_id, round=current[0]), PEER_RECORD_TTL_S)
            await asyncio.sleep(PEER_RECORD_TTL_S / 4)

    beating = asyncio.create_task(heartbeat())
    for r in range(rounds):
        current[0] = r
        await publish_peer(peer.dht, peer.validator, LOCOMESH_RUN, PeerRecord(peer_id=peer.peer_id, round=r), PEER_RECORD_TTL_S)
        theta = [p - torch.randn(p.shape, generator=g) * 0.01 for p in peer.phi]
        await wait()
        sent, received = peer.counts["sent"], peer.counts["received"]
        meter.start()
        result = await peer.averager.run_round(r, peer.phi, theta, samples=16)
        out.put({"rank": rank, "round_s": result.duration_s, "gather_s": result.gather_s, "exchange_s": result.exchange_s,
                 "complete": len(result.contributors) == n and len(result.group) == n,
                 "moved": peer.counts["sent"] - sent + peer.counts["received"] - received, **meter.stop()})
        del theta
    beating.cancel()
    await wait()
    await peer.dht.shutdown()
    await peer.p2p.shutdown()


# --- driver ----------------------------------------------------------------------------------------

def run_system(system: str, n: int, numel: int, dtype: str, rounds: int, timeout: float = 900.0) -> dict[str, Any]:
    """One row: ``system`` with ``n`` peer processes, ``rounds`` rounds of ``numel`` parameters."""
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    barrier, out = ctx.Barrier(n), ctx.Queue()
    shared = manager.list([0] * n if system == "tcp" else [[]])
    if system == "tcp":
        target, args = _tcp_peer, (numel * (4 if dtype == "fp32" else 2), shared, barrier, out, rounds)
    else:
        target = {"hivemind": _hivemind_peer, "locomesh": _locomesh_peer, "locomesh-libp2p": _locomesh_libp2p_peer}[system]
        args = (numel, dtype, shared, barrier, out, rounds)
    procs = []
    rows: list[dict] = []
    started = time.monotonic()
    threads = max(1, (os.cpu_count() or 1) // n)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the peers share the cores: spinning OpenMP threads of one would starve the others
    try:
        for rank in range(n):
            procs.append(ctx.Process(target=target, args=(rank, n, *args), daemon=False))
            procs[-1].start()
            if rank == 0 and system != "tcp":
                while not shared[0] and time.monotonic() - started < 120 and procs[0].is_alive():
                    time.sleep(0.2)
        while len(rows) < n * rounds and time.monotonic() - started < timeout:
            if not all(p.is_alive() for p in procs) and out.empty():
                break
            try:
                rows.append(out.get(timeout=1.0))
            except Exception:
                continue
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        manager.shutdown()
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return {**summarize(system, n, numel, dtype, rounds, rows), "threads_per_peer": threads}


def summarize(system: str, n: int, numel: int, dtype: str, rounds: int, rows: list[dict]) -> dict[str, Any]:
    by_round: list[list[dict]] = [[] for _ in range(rounds)]
    counts: dict[int, int] = {}
    for row in rows:
        k = counts.get(row["rank"], 0)
        counts[row["rank"]] = k + 1
        if k < rounds:
            by_round[k].append(row)
    steady = [row for rnd in by_round[1:] for row in rnd] if rounds > 1 else rows
    payload = numel * (4 if dtype == "fp32" else 2)
    report: dict[str, Any] = {"system": system, "peers": n, "params": numel, "dtype": dtype, "payload_mb": payload / 1e6,
                              "rounds": rounds, "rows": len(rows), "finished": len(rows) == n * rounds}
    if not steady:
        return report
    median = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    report.update({
        "round_s": median("round_s"),
        "round_s_max": max(r["round_s"] for r in steady),
        "mb_per_s": statistics.median(r["moved"] / r["round_s"] / 1e6 for r in steady),
        "complete_rounds": sum(all(r["complete"] for r in rnd) and len(rnd) == n for rnd in by_round[1:]),
        "cpu_s": median("cpu_s"),
        **({"minor_faults": (faults := median("minor_faults")), "fresh_mb": faults * 4096 / 1e6} if "minor_faults" in steady[0] else {}),
        "transient_mb": max(r["transient_mb"] for r in steady),
        "transient_x_payload": max(r["transient_mb"] for r in steady) * 1e6 / payload,
        "rss_mb": max(r["rss_mb"] for r in steady),
        "held_mb": max(r["held_mb"] for r in steady),
        "held_x_payload": max(r["held_mb"] for r in steady) * 1e6 / payload,
    })
    for key in ("gather_s", "exchange_s"):
        if key in steady[0]:
            report[key] = median(key)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="25e6,100e6", help="comma-separated parameter counts")
    ap.add_argument("--peers", default="2,4", help="comma-separated peer counts")
    ap.add_argument("--dtypes", default="fp32", help="fp32 and/or bf16 (locomesh's codec; hivemind's fp16 compression)")
    ap.add_argument("--systems", default="tcp,hivemind,locomesh-libp2p,locomesh")
    ap.add_argument("--plan", help="sizes, their peer counts and (optionally) dtypes instead of --params x --peers x --dtypes, "
                    "e.g. '25e6:2,4,8:fp32,bf16 100e6:2,4 250e6:2' (the largest sizes at fewer peers: every peer holds the model)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    meta = results_io.begin(None if argv is None else ["python", "-m", "benchmarks.wire", *argv])
    runs: list[dict] = []
    plan = [(int(float(x)), [int(n) for n in args.peers.split(",")], args.dtypes.split(",")) for x in args.params.split(",")]
    if args.plan:
        entries = [(p.split(":") + [args.dtypes])[:3] for p in args.plan.split()]
        plan = [(int(float(size)), [int(x) for x in counts.split(",")], dtypes.split(",")) for size, counts, dtypes in entries]
    for numel, counts, dtypes in plan:
        for n in counts:
            for dtype in dtypes:
                for system in args.systems.split(","):
                    t = time.monotonic()
                    row = run_system(system, n, numel, dtype, args.rounds)
                    runs.append(row)
                    results_io.write(Path(args.out), {"runs": runs}, meta)
                    print(f"{system:9s} {n} peers {numel / 1e6:6.0f}M {dtype}: round {row.get('round_s', float('nan')):.3f}s "
                          f"{row.get('mb_per_s', float('nan')):7.0f} MB/s, complete {row.get('complete_rounds')}/{args.rounds - 1}, "
                          f"transient {row.get('transient_mb', float('nan')):.0f} MB ({row.get('transient_x_payload', float('nan')):.1f}x), "
                          f"held {row.get('held_mb', float('nan')):.0f} MB ({row.get('held_x_payload', float('nan')):.1f}x), "
                          f"cpu {row.get('cpu_s', float('nan')):.2f}s [{time.monotonic() - t:.0f}s]", flush=True)
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
