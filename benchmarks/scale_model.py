"""The cost model behind ``benchmarks.scale``'s ``simulated`` rows: one DiLoCo round of N peers over
real links, calibrated on the measured loopback runs.

A dense round of a group of g members reduce-scatters over ``parts`` wire parts, dealt evenly to
``owners = min(g, parts)`` owners (the layout is fixed per run, so a group larger than the part count
leaves members without parts). With payload B (bytes of one member's update):

- phase 1: every member sends each owner that owner's share of its update; an owner receives
  (g − 1) × B / owners;
- phase 2: each owner sends its reduced share to the g − 1 others; every member receives B minus its
  own share.

So a member that owns a share sends B × (1 − 1/owners) + (g − 1) × B / owners, which is
2 × (g − 1)/g × B while owners = g, and every peer on average sends 2 × (g − 1)/g × B. Each of the
2 × (g − 1) streams a member opens or serves adds ``stream_overhead`` bytes (requests, headers,
framing; measured). The round's time is bound by its busiest member's upload:
rendezvous + 2 × RTT + max_sent / bandwidth, with the rendezvous = a DHT lookup of ``hops`` =
1 + ceil(log2(N / 8)) sequential requests (one beyond 8 peers, where reads go to the nearest nodes)
× RTT + one poll interval (0.2 s). DHT requests per peer per round are a + b × log2(N), fitted on
the measured sizes. Codec and reduction compute, and p2pd's own per-stream costs, are left out:
on real links they are small next to the transfer, on loopback they are all there is.

Bounded groups are unequal, as measured (16 peers in groups of 8 came out as 5 and 11): the model
deals N synthetic peer ids into groups with ``gossip.groups`` over several rounds, as the daemon
does; the mean bytes are weighted by members, and the busiest member and the round time come from
the round's largest group (median over the rounds). Every row is named ``simulated: ...``.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from gossip.groups import group_count, split_into_groups
from gossip.reduce_scatter import wire_partition

SIM_PEERS = (256, 1000, 4000)
LINKS = (
    {"link": "20 Mbit/s, 50 ms RTT", "bytes_per_s": 20e6 / 8, "rtt_s": 0.05},
    {"link": "1 Gbit/s, 10 ms RTT", "bytes_per_s": 1e9 / 8, "rtt_s": 0.01},
)
POLL_S = 0.2
SIM_ROUNDS = 8  # rounds of synthetic group draws per simulated swarm


ROW = 1024


def synthetic_shapes(params: int) -> list[tuple[int, ...]]:
    """A model-like list of shapes holding ``params`` values: matrices of 1024 columns and a remainder."""
    rows, rest = divmod(params, ROW)
    shapes: list[tuple[int, ...]] = [(min(256, rows - i), ROW) for i in range(0, rows, 256)]
    if rest:
        shapes.append((rest,))
    return shapes


def part_count(params: int, codec: str = "none") -> int:
    shapes = synthetic_shapes(params)
    return len(wire_partition(codec, shapes).shapes(shapes))


def _fit_log(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a + b·log2(n) through (n, y) points (b = 0 with one point)."""
    xs = [math.log2(n) for n, _ in points]
    ys = [y for _, y in points]
    if len(points) < 2:
        return ys[0] if ys else 0.0, 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - b * mx, b


def calibrate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-stream overhead and the DHT request fit from the measured runs."""
    overheads = []
    for run in runs:
        g, payload = run["peers"], run["payload_bytes"]
        if payload and "reduce-scatter" in run["schemes"]:
            ideal = 2 * (g - 1) / g * payload
            overheads.append(max(0.0, (run["bytes_sent_per_node_per_round"] - ideal) / (2 * (g - 1))))
    a, b = _fit_log([(run["peers"], run["dht_requests_per_node_per_round"]) for run in runs])
    params = runs[0]["params"] if runs else 0
    return {"stream_overhead_bytes": statistics.median(overheads) if overheads else 0.0, "dht_a": a, "dht_b": b,
            "parts": part_count(params, runs[0]["codec"]) if runs else 0,
            "fit": "dht_requests = a + b * log2(peers), least squares over the measured sizes"}


def group_sizes(peers: int, max_group_size: int, rounds: int = SIM_ROUNDS) -> list[list[int]]:
    """Per round, the sizes of the non-empty groups ``peers`` synthetic members fall into (``gossip.groups``)."""
    count = group_count(peers, max_group_size)
    members = [f"sim-peer-{i}" for i in range(peers)]
    return [[len(g) for g in split_into_groups("simulated", r, members, count) if g] for r in range(rounds)]


def _member_cost(g: float, model: dict[str, Any], payload: int) -> tuple[float, float, int]:
    """(mean bytes a member of a group of g sends, bytes its busiest owner sends, owners)."""
    owners = max(1, min(g, model["parts"]))
    share = payload / owners
    overhead = 2 * (g - 1) * model["stream_overhead_bytes"]
    return 2 * (g - 1) / g * payload + overhead, payload - share + (g - 1) * share + overhead, owners


def simulate(model: dict[str, Any], peers: int, payload: int, link: dict[str, Any], max_group_size: int | None = None) -> dict[str, Any]:
    """One round's cost per peer for ``peers`` peers in one group (``max_group_size`` None) or in bounded
    groups drawn as the daemon draws them (unequal: the busiest member is in the largest group). A
    grouped round sends the members' weights, as many bytes as the update."""
    rounds = [[peers]] if max_group_size is None else group_sizes(peers, max_group_size)
    mean_sent = statistics.fmean(sum(g * _member_cost(g, model, payload)[0] for g in sizes) / sum(sizes) for sizes in rounds)
    largest = statistics.median(max(sizes) for sizes in rounds)
    _, owner_sent, owners = _member_cost(largest, model, payload)
    hops = 1 + max(0, math.ceil(math.log2(peers / 8)))
    rendezvous = hops * link["rtt_s"] + POLL_S
    round_s = rendezvous + 2 * link["rtt_s"] + owner_sent / link["bytes_per_s"]
    g = peers if max_group_size is None else peers / group_count(peers, max_group_size)
    return {
        "name": f"simulated: {peers} peers, " + ("one group" if max_group_size is None else f"groups of <= {max_group_size}")
                + f", {link['link']}",
        "simulated": True, "peers": peers, "group": g, "largest_group": largest, "link": link["link"], "payload_bytes": payload,
        "owners": owners, "bytes_sent_per_node_per_round": mean_sent, "bytes_received_per_node_per_round": mean_sent,
        "bytes_sent_busiest_node_per_round": owner_sent,
        "round_s_median": round_s, "round_s_p95": round_s,
        "dht_requests_per_node_per_round": model["dht_a"] + model["dht_b"] * math.log2(peers),
    }
