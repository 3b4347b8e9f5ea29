"""DiLoCo members in one process, for unit tests of whole outer rounds over the in-memory transport
(``tests.helpers.memory_transport``). The tests replace the DHT rendezvous themselves (they monkeypatch
``gossip.group_rendezvous.gather_group`` and ``round_members``): these members have no DHT."""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import torch

from gossip.diloco import DiLoCoAverager
from gossip.group_round import RoundResult
from gossip.exchange import RoundExchange
from gossip.outer import NesterovOuter
from gossip.partition import Partition
from tests.helpers.memory_transport import Network


def diloco_members(n: int, network: Network, shapes: Sequence[tuple[int, ...]], codec: str = "none", part_numel: int = 256,
                   seed: int = 0, lr: float = 1.0, fetch_timeout: float = 3, serve_timeout: float = 5, gather_timeout: float = 3,
                   max_group_size: int | None = None, samples: Sequence[int] | None = None) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """``n`` members ``peer00``, ``peer01``, ... on ``network`` (run ``run``, outer step: ``lr``, no momentum),
    all holding the same random φ of ``shapes``, each with its own random Δ.

    Returns φ and the members, each a dict: ``peer``, ``exchange``, ``averager``, ``phi`` (its copy of φ),
    ``theta`` (φ − Δ), ``delta`` and ``samples`` (``samples[k]``, or 8·(k+1)).
    """
    g = torch.Generator().manual_seed(seed)
    phi = [torch.randn(s, generator=g) for s in shapes]
    members = []
    for k in range(n):
        peer = f"peer{k:02d}"
        exchange = RoundExchange(network.transport(peer), "run", codec, Partition(part_numel).shapes(shapes), serve_timeout=serve_timeout)
        averager = DiLoCoAverager(None, None, exchange, "run", peer, NesterovOuter(lr=lr, momentum=0.0),  # type: ignore[arg-type]
                                  gather_timeout=gather_timeout, fetch_timeout=fetch_timeout, partition=Partition(part_numel),
                                  max_group_size=max_group_size)
        delta = [torch.randn(s, generator=g) for s in shapes]
        members.append({"peer": peer, "exchange": exchange, "averager": averager, "phi": [p.clone() for p in phi],
                        "theta": [p - d for p, d in zip(phi, delta)], "delta": delta,
                        "samples": samples[k] if samples else 8 * (k + 1)})
    return phi, members


async def run_round_together(members: list[dict[str, Any]], round_no: int = 0) -> list[RoundResult]:
    """Start every member's exchange, then run round ``round_no`` on all of them at once."""
    for m in members:
        await m["exchange"].start()
    return await asyncio.gather(*(m["averager"].run_round(round_no, m["phi"], m["theta"], m["samples"]) for m in members))
