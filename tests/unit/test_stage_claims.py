"""What a pipeline stage server takes from the other replicas of its stage is bounded: a replica's sample
count is a claim, capped at a multiple of what this replica stepped itself in its recent rounds (one
replica claiming 10^18 samples owned every ``mean``), and a downloaded state's metadata is checked."""

from collections import deque
from types import SimpleNamespace

import torch

from gossip.aggregate import aggregate
from gossip.state_transfer import meta_int
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


def test_downloaded_metadata_of_the_wrong_type_or_range_is_replaced_not_raised() -> None:
    """A stage download's ``first_round`` and ``stage_steps`` come from its source, outside the digests: a
    non-integer ``first_round`` used to raise out of the download loop."""
    meta = {"first_round": "x", "stage_steps": -5, "ok": 7, "flag": True}
    assert meta_int(meta, "first_round", 0, 10, 0) == 0
    assert meta_int(meta, "stage_steps", 0, 2**62, 0) == 0
    assert meta_int(meta, "ok", 0, 10, 0) == 7 and meta_int(meta, "ok", 0, 5, 1) == 1
    assert meta_int(meta, "flag", 0, 10, 3) == 3 and meta_int(meta, "missing", 0, 10, 4) == 4


def test_a_stage_download_asks_only_replicas_that_answer_a_probe(monkeypatch) -> None:
    """A stage replica's record can be signed by a key no daemon runs: it is neither asked for the stage's
    state nor waited for at the stage's rendezvous (the averager gets the same prober)."""
    import asyncio

    import node.pipeline.stage_server as stage_server
    from gossip.state_sources import SourcePlan
    from protocol.records import PeerRecord

    planned: list[dict[str, int]] = []

    async def plan_sources(transport, rounds, *args, **kwargs):
        planned.append(dict(rounds))
        return SourcePlan([])

    async def check(peers: set[str]) -> set[str]:
        return peers & {"real"}

    monkeypatch.setattr(stage_server, "plan_sources", plan_sources)
    server = StageServer.__new__(StageServer)
    server.summary = SimpleNamespace(peer_id="me")
    server.reachable = SimpleNamespace(check=check)
    server.net = SimpleNamespace(call=lambda coro, timeout: asyncio.run(coro), transport=None)
    server.averager = SimpleNamespace(tenure=SimpleNamespace(established=lambda peer: False))
    server.metrics = SimpleNamespace(errors=None)
    peers = {p: PeerRecord(peer_id=p, role="stage", round=3) for p in ("real", "invented", "me")}
    assert server._download(torch.nn.Linear(2, 2), "run.stage0", peers) is None
    assert planned == [{"real": 3}]
    server.reachable = SimpleNamespace(check=lambda peers: check(set()))  # nobody answers: ask them all
    server._download(torch.nn.Linear(2, 2), "run.stage0", peers)
    assert planned[-1] == {"real": 3, "invented": 3}
