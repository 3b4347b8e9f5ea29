"""What a pipeline stage server takes from the other replicas of its stage is bounded: a replica's sample
count is a claim, capped at a multiple of the round's lower-median claim (one replica claiming 10^18
samples owned every ``mean``), alike on every replica, and a downloaded state's metadata is checked."""

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.aggregate import aggregate, claim_cap
from gossip.state_transfer import meta_int
from node.pipeline.stage_server import CLAIM_FACTOR, StageServer


def test_a_stage_server_caps_claims_relative_to_the_round_and_sends_its_own_count_as_it_is() -> None:
    server = StageServer.__new__(StageServer)
    rounds: list = []
    server.placement = SimpleNamespace(device=torch.device("cpu"))
    server.phi, server.feedback = [torch.zeros(2)], None
    server.averager = SimpleNamespace(max_samples=None, claim_factor=CLAIM_FACTOR,
                                      run_round=lambda *a, **k: rounds.append((a, k)) or "round")
    server.net = SimpleNamespace(submit=lambda coro: coro)
    for epoch, samples in enumerate([32, 64, 16]):
        server._start_round(epoch, SimpleNamespace(samples=samples, snapshot=lambda device: [torch.ones(2)]))  # type: ignore[arg-type]
    assert [a[3] for a, _ in rounds] == [32, 64, 16], "its own count goes out as it is"
    assert server.averager.max_samples is None, "no cap of this replica's own making"


def test_a_claim_of_1e18_samples_weighs_no_more_than_the_cap() -> None:
    honest, liar = [torch.zeros(4)], [torch.ones(4)]
    result = aggregate(["me", "liar"], [honest, liar], [64, 10**18], "mean", claim_factor=CLAIM_FACTOR)
    assert result.capped == {"liar": 10**18}
    assert torch.allclose(result.update[0], torch.full((4,), CLAIM_FACTOR / (CLAIM_FACTOR + 1)))


def test_replicas_that_stepped_unevenly_weigh_alike_on_both() -> None:
    """The router gave one replica 1 microbatch and the other 80 in a round: under the old rule (8 × what
    each stepped itself) the first capped the second's claim at 64 and the second did not, so the two
    stepped φ apart with both in sync. Each now aggregates the same inputs to the same bits."""
    a, b = [torch.randn(64, generator=torch.Generator().manual_seed(1))], [torch.randn(64, generator=torch.Generator().manual_seed(2))]
    on_a = aggregate(["a", "b"], [a, b], [8, 640], "mean", claim_factor=CLAIM_FACTOR)
    on_b = aggregate(["a", "b"], [a, b], [8, 640], "mean", claim_factor=CLAIM_FACTOR)
    assert torch.equal(on_a.update[0], on_b.update[0]) and on_a.capped == {"b": 640}
    assert torch.allclose(on_a.update[0], (8 * a[0] + 64 * b[0]) / 72)


def test_a_claim_of_no_samples_does_not_zero_every_weight() -> None:
    result = aggregate(["liar", "me"], [[torch.ones(4)], [torch.zeros(4)]], [0, 640], "mean", claim_factor=CLAIM_FACTOR)
    assert torch.allclose(result.update[0], torch.zeros(4)), "the liar weighs nothing; the honest update stands"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**18), min_size=1, max_size=9), st.integers(1, 16), st.one_of(st.none(), st.integers(1, 10**6)))
def test_a_liar_among_honest_claims_weighs_at_most_the_factor_times_an_honest_claim(honest, factor, max_samples) -> None:
    """With a strict honest majority, the lower median is an honest claim (or below one): no claim, the
    liar's included, weighs more than ``factor`` × the largest honest claim (or 1); the cap never exceeds
    ``max_samples``; and a cap is a function of the claims as a set (members order them alike)."""
    cap = claim_cap([*honest, 10**18], max_samples, factor)
    assert cap is not None
    if len(honest) >= 2:
        assert cap <= max(1, factor * max(min(s, max_samples or s) for s in honest))
    if max_samples is not None:
        assert cap <= max_samples
    assert cap == claim_cap([10**18, *reversed(honest)], max_samples, factor)


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

    import node.pipeline.stage_state as stage_state
    from gossip.state_sources import SourcePlan
    from protocol.records import PeerRecord

    planned: list[dict[str, int]] = []

    async def plan_sources(transport, rounds, *args, **kwargs):
        planned.append(dict(rounds))
        return SourcePlan([])

    async def check(peers: set[str]) -> set[str]:
        return peers & {"real"}

    monkeypatch.setattr(stage_state, "plan_sources", plan_sources)
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
