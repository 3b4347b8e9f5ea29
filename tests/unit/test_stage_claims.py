"""A pipeline stage replica's sample count is a claim: the stage server caps what any replica of its stage
may weigh at a multiple of what it stepped itself in its recent rounds (issue: one replica claiming 10^18
samples owned every ``mean`` and pulled ``centered-clip`` toward itself)."""

from collections import deque
from types import SimpleNamespace

import torch

from gossip.aggregate import aggregate
from node.pipeline.stage_server import CLAIM_FACTOR, CLAIM_WINDOW, StageServer


def _server() -> tuple[StageServer, list]:
    server = StageServer.__new__(StageServer)
    rounds: list = []
    server.own_samples = deque(maxlen=CLAIM_WINDOW)
    server.placement = SimpleNamespace(device=torch.device("cpu"))
    server.phi, server.feedback = [torch.zeros(2)], None
    server.averager = SimpleNamespace(max_samples=None, run_round=lambda *a, **k: rounds.append((a, k)) or "round")
    server.net = SimpleNamespace(submit=lambda coro: coro)
    return server, rounds


def _worker(samples: int) -> SimpleNamespace:
    return SimpleNamespace(samples=samples, snapshot=lambda device: [torch.ones(2)])


def test_every_round_caps_claims_at_a_multiple_of_what_this_replica_stepped() -> None:
    server, rounds = _server()
    for epoch, samples in enumerate([32, 64, 16]):
        server._start_round(epoch, _worker(samples))  # type: ignore[arg-type]
        assert server.averager.max_samples == CLAIM_FACTOR * max([32, 64, 16][: epoch + 1])
    assert [a[3] for a, _ in rounds] == [32, 64, 16], "its own count goes out as it is"
    for epoch in range(3, 3 + CLAIM_WINDOW):  # the window moves on: old rounds stop counting
        server._start_round(epoch, _worker(8))  # type: ignore[arg-type]
    assert server.averager.max_samples == CLAIM_FACTOR * 8


def test_a_claim_of_1e18_samples_weighs_no_more_than_the_cap() -> None:
    server, _ = _server()
    server._start_round(0, _worker(64))  # type: ignore[arg-type]
    honest, liar = [torch.zeros(4)], [torch.ones(4)]
    result = aggregate(["me", "liar"], [honest, liar], [64, 10**18], "mean", max_samples=server.averager.max_samples)
    assert result.capped == {"liar": 10**18}
    assert torch.allclose(result.update[0], torch.full((4,), CLAIM_FACTOR / (CLAIM_FACTOR + 1)))
