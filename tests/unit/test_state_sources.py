"""Every whole-state download takes the state most peers hold, from its holders: a peer announcing round
10⁹ is never asked, one serving another state is skipped and counted, one with other settings does not
stop a joiner, and a resync or a pipeline stage's download cannot be handed the vote's choice's poison.

Real state servers answer over in-memory streams; the joiner and the stage server run their own code
on a network thread of their own (``LoopNet``), as in the daemon."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any, Coroutine

import pytest
import torch

from gossip.state_sources import SourcePlan, attempts_of, plan_sources, rank_candidates
from gossip.state_server import StateServer
from gossip.state_transfer import StateSnapshot, group_digests
from gossip.votes import Tenure
from node.errors import JoinRefused
from node.replica.joiner import Joiner
from node.runtime.metrics import NodeMetrics
from tests.helpers.memory_transport import Network

SHAPES = [(16, 8), (8,)]
ROUND = 6
SETTINGS = {"model": "nano", "algorithm": "diloco"}


def _state(seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"params": [torch.randn(s, generator=g) for s in SHAPES], "outer_momentum": [torch.randn(s, generator=g) for s in SHAPES]}


HONEST, OTHER = _state(0), _state(1)
LAYOUT = {name: [(tuple(t.shape), t.dtype) for t in ts] for name, ts in HONEST.items()}


class LoopNet:
    """A network thread over a memory network: ``call`` runs a coroutine on its loop and waits, as
    ``node.runtime.network.NetworkThread.call`` does."""

    def __init__(self, network: Network, peer: str) -> None:
        self.network, self.transport, self.dht = network, network.transport(peer), None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, peer: str, state: dict[str, list[torch.Tensor]], round_no: int = ROUND, meta: dict | None = None,
              run_id: str = "run") -> StateServer:
        server = StateServer(self.network.transport(peer), run_id, progress=lambda: 2)  # type: ignore[arg-type]
        self.call(server.start())
        server.publish(StateSnapshot(round=round_no, tensors=state, fingerprint="fp", meta=dict(SETTINGS if meta is None else meta)))
        return server

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def net():
    loop_net = LoopNet(Network(), "joiner")
    yield loop_net
    loop_net.close()


def _joiner(net: LoopNet, records: dict[str, int]) -> tuple[Joiner, list[dict[str, list[torch.Tensor]]], list[tuple[str, dict]]]:
    """A joiner that lists ``records`` ({peer: announced round}) as the run's trainers."""
    adopted: list[dict[str, list[torch.Tensor]]] = []
    events: list[tuple[str, dict]] = []

    async def announce() -> None:
        return None

    joiner = Joiner(net=net, run_id="run", peer_id="joiner", settings=dict(SETTINGS), layout=lambda: LAYOUT,  # type: ignore[arg-type]
                    adopt=lambda got: adopted.append(got.snapshot.tensors), announce=announce, metrics=NodeMetrics(),
                    event=lambda kind, **fields: events.append((kind, fields)), stop=threading.Event(), join_timeout=5.0)
    joiner._trainers = lambda: [SimpleNamespace(peer_id=p, round=r, role="trainer") for p, r in records.items()]  # type: ignore[method-assign]
    return joiner, adopted, events


def _same(a: dict[str, list[torch.Tensor]], b: dict[str, list[torch.Tensor]]) -> bool:
    return group_digests(a) == group_digests(b)


def test_the_round_most_peers_announce_decides_and_a_far_ahead_claim_is_not_asked() -> None:
    near, ignored = rank_candidates({"a": 5, "b": 5, "c": 6, "liar": 10**9})
    assert sorted(near[:2]) == ["a", "b"] and near[2] == "c" and ignored == ["liar"]
    near, _ = rank_candidates({"a": 5, "b": 5, "c": 4}, prefer="c")
    assert near[0] == "c", "the caller's choice leads when it is near the swarm's round"
    assert rank_candidates({}) == ([], [])
    assert attempts_of(["a", "b", "c"], stripe=2) == [["a", "b"], ["a"], ["b"], ["c"]]
    assert attempts_of(["a", "b"], stripe=1) == [["a"], ["b"]]


def test_a_plan_downloads_only_from_the_majoritys_holders(net: LoopNet) -> None:
    for peer in ("a", "b", "c"):
        net.serve(peer, HONEST)
    net.serve("liar", OTHER)
    net.serve("ahead", OTHER, round_no=10**9)
    plan = net.call(plan_sources(net.transport, {"a": ROUND, "b": ROUND, "c": ROUND, "liar": ROUND, "ahead": 10**9}, "run", LAYOUT))
    assert plan.trusted == group_digests(HONEST) and plan.round == ROUND
    assert sorted({p for attempt in plan.attempts for p in attempt}) == ["a", "b", "c"]
    assert plan.dissent == ["liar"] and plan.ignored == ["ahead"]
    assert net.network.sent.get("ahead", 0) == 0, "a far-ahead claimer is not even asked for its header"


def test_fresh_ids_do_not_outvote_established_peers(net: LoopNet) -> None:
    for peer in ("old1", "old2"):
        net.serve(peer, HONEST)
    for peer in ("new1", "new2", "new3"):
        net.serve(peer, OTHER)
    rounds = dict.fromkeys(("new1", "new2", "new3", "old1", "old2"), ROUND)
    plan = net.call(plan_sources(net.transport, rounds, "run", LAYOUT, established=lambda p: p.startswith("old")))
    assert plan.trusted == group_digests(HONEST) and sorted(plan.dissent) == ["new1", "new2", "new3"]
    assert sorted(plan.attempts[0]) == ["old1", "old2"], "established peers are asked first"
    counted_by_id = net.call(plan_sources(net.transport, rounds, "run", LAYOUT))
    assert counted_by_id.trusted == group_digests(OTHER), "without tenure, three ids outvote two (a joiner's first window)"


def test_ties_are_drawn_not_ordered_by_the_peer_ids_an_attacker_grinds(monkeypatch) -> None:
    """Candidates alike in every other way were ordered by peer id, so a fresh joiner (no established
    peer yet) asked the 5 lowest ids, which a Sybil grinds for free. The draw is keyed by a secret of
    this process: the same order within it, another in the next."""
    from gossip import state_sources

    rounds = {f"peer{i:02d}": 5 for i in range(40)}
    orders = []
    for key in (b"\x01" * 16, b"\x02" * 16):
        monkeypatch.setattr(state_sources, "_DRAW_KEY", key)
        near, _ = rank_candidates(rounds)
        assert near == rank_candidates(rounds)[0] and sorted(near) == sorted(rounds)
        orders.append(near)
    assert orders[0] != orders[1] and sorted(rounds)[:5] not in (orders[0][:5], orders[1][:5])


def test_a_majority_of_an_older_round_waits_or_falls_back(net: LoopNet) -> None:
    for peer in ("a", "b"):
        net.serve(peer, HONEST, round_no=ROUND - 1)
    rounds = {"a": ROUND, "b": ROUND}
    waiting = net.call(plan_sources(net.transport, rounds, "run", LAYOUT, min_round=ROUND, fallback=False))
    assert waiting == SourcePlan([])
    fallback = net.call(plan_sources(net.transport, rounds, "run", LAYOUT, min_round=ROUND))
    assert fallback.trusted is None and sorted(fallback.attempts[0]) == ["a", "b"]
    assert fallback.attempts[1:] == [[p] for p in fallback.attempts[0]]


def test_a_joiner_takes_the_majoritys_state_not_the_claimer_of_round_1e9s(net: LoopNet) -> None:
    for peer in ("a", "b"):
        net.serve(peer, HONEST)
    net.serve("liar", OTHER, round_no=10**9)
    joiner, adopted, events = _joiner(net, {"liar": 10**9, "a": ROUND, "b": ROUND})
    assert joiner.join(resumed=False)
    assert len(adopted) == 1 and _same(adopted[0], HONEST)
    assert events[-1][1]["verified"] == "majority"


def test_a_join_at_a_rounds_end_asks_again_rather_than_trust_one_peers_own_header(net: LoopNet, monkeypatch) -> None:
    """One honest peer has ended round R, the other not yet, and a liar serves its own state at R: no state has a
    majority, and the fallback (each candidate checked against its own header, nearest the round most announce
    first) put the liar first whenever it won the draw. The join asks again until the honest peers agree."""
    from gossip import state_sources

    monkeypatch.setattr(state_sources, "_draw", lambda peer: b"" if peer == "liar" else peer.encode())  # the liar wins every draw
    ended = _state(2)
    net.serve("a", ended, round_no=ROUND + 1)
    behind = net.serve("b", HONEST)
    net.serve("liar", OTHER)
    records = {"a": ROUND + 1, "b": ROUND, "liar": ROUND}
    joiner, adopted, events = _joiner(net, records)

    def b_ends_its_round() -> None:
        behind.publish(StateSnapshot(round=ROUND + 1, tensors=ended, fingerprint="fp", meta=dict(SETTINGS)))
        records["b"] = ROUND + 1

    timer = threading.Timer(1.5, b_ends_its_round)
    timer.start()
    try:
        assert joiner.join(resumed=False)
    finally:
        timer.cancel()
    assert len(adopted) == 1 and _same(adopted[0], ended) and events[-1][1]["verified"] == "majority", events[-1]


def test_invented_members_cannot_make_the_live_peer_look_far_ahead(net: LoopNet) -> None:
    net.serve("live", HONEST, round_no=ROUND)
    invented = {f"invented{i}": 0 for i in range(3)}  # records signed by keys no daemon runs, at round 0
    joiner, adopted, _ = _joiner(net, {**invented, "live": ROUND})
    joiner.join_timeout = 2.0

    async def answering(peers: set[str]) -> set[str]:
        return {p for p in peers if any(owner == p for owner, _ in net.network.handlers)}

    joiner.answering = answering
    assert joiner.join(resumed=False) and _same(adopted[0], HONEST)


def test_one_peer_with_other_settings_does_not_stop_a_joiner(net: LoopNet) -> None:
    net.serve("0odd", OTHER, meta={"model": "llama-small", "algorithm": "diloco"})  # asked first alone (ids sort "0" < "a")
    net.serve("a", HONEST)
    joiner, adopted, events = _joiner(net, {"0odd": ROUND, "a": ROUND})
    assert joiner.join(resumed=False) and _same(adopted[0], HONEST) and events[-1][1]["peer"] == "a"


def test_a_joiner_is_refused_only_when_every_peer_has_other_settings(net: LoopNet) -> None:
    for peer in ("a", "b"):
        net.serve(peer, HONEST, meta={"model": "llama-small", "algorithm": "diloco"})
    joiner, adopted, _ = _joiner(net, {"a": ROUND, "b": ROUND})
    with pytest.raises(JoinRefused, match="--model llama-small"):
        joiner.join(resumed=False)
    assert adopted == []


def test_a_resync_skips_the_votes_choice_when_the_round_majority_holds_another_state(net: LoopNet) -> None:
    net.serve("chosen", OTHER, round_no=ROUND + 1)  # the vote's pick serves a state of its own making
    for peer in ("a", "b"):
        net.serve(peer, HONEST, round_no=ROUND + 1)
    joiner, adopted, events = _joiner(net, {})
    joiner.resync("chosen", ROUND, members=["chosen", "a", "b", "joiner"])
    assert len(adopted) == 1 and _same(adopted[0], HONEST)
    assert events[-1][0] == "resynced" and "chosen" not in events[-1][1]["peer"] and events[-1][1]["verified"] == "majority"
    assert joiner.metrics.errors.labels("poisoned")._value.get() == 1


def test_a_resync_counts_only_the_established_members_when_it_knows_some(net: LoopNet) -> None:
    for peer in ("chosen", "fake1", "fake2"):
        net.serve(peer, OTHER, round_no=ROUND + 1)
    for peer in ("a", "b"):
        net.serve(peer, HONEST, round_no=ROUND + 1)
    joiner, adopted, _ = _joiner(net, {})
    joiner.established = lambda peer: peer in ("a", "b")
    joiner.resync("chosen", ROUND, members=["chosen", "fake1", "fake2", "a", "b"])
    assert len(adopted) == 1 and _same(adopted[0], HONEST)


def test_a_resync_with_one_member_takes_its_state(net: LoopNet) -> None:
    net.serve("only", HONEST, round_no=ROUND + 1)
    joiner, adopted, events = _joiner(net, {})
    joiner.resync("only", ROUND, members=["only"])
    assert len(adopted) == 1 and events[-1][1] == {"peer": "only", "round": ROUND + 1, "fingerprint": "fp", "verified": "own_header"}


def test_a_resync_to_a_state_no_majority_vouches_for_keeps_its_own_when_the_judge_refuses_it(net: LoopNet) -> None:
    """A start-up tie: the vote can pick any member's φ, a hostile one's included (a scaling attacker that
    averaged alone). The judge sees it before adoption; the node keeps its own φ and does not retry."""
    net.serve("chosen", OTHER, round_no=ROUND + 1)
    joiner, adopted, events = _joiner(net, {})
    judged: list[str] = []
    joiner.judge = lambda got: judged.append(got.peer) or "it scores 12 against 3.4"
    joiner.resync("chosen", ROUND, members=["chosen"])
    assert adopted == [] and judged == ["chosen"]
    assert events[-1][0] == "resync_refused" and "it scores 12 against 3.4" in events[-1][1]["reason"]
    assert joiner.metrics.state_downloads.labels("refused")._value.get() == 1


def test_a_state_the_round_majority_vouches_for_is_not_judged(net: LoopNet) -> None:
    for peer in ("a", "b"):
        net.serve(peer, HONEST, round_no=ROUND + 1)
    joiner, adopted, _ = _joiner(net, {})
    joiner.judge = lambda got: pytest.fail("a majority's state was judged")
    joiner.resync("a", ROUND, members=["a", "b", "joiner"])
    assert len(adopted) == 1 and _same(adopted[0], HONEST)


def test_a_catch_up_downloads_the_target_rounds_majority(net: LoopNet) -> None:
    net.serve("liar", OTHER, round_no=ROUND)
    for peer in ("a", "b"):
        net.serve(peer, HONEST, round_no=ROUND)
    joiner, adopted, events = _joiner(net, {"liar": ROUND, "a": ROUND, "b": ROUND})
    joiner.established = lambda peer: True  # all three established: the liar ("l" > "b") would be the preferred source
    assert joiner.catch_up(ROUND - 1, keep_weights=False) == ROUND
    assert len(adopted) == 1 and _same(adopted[0], HONEST) and "liar" not in events[-1][1]["peer"]


def _stage_role(net: LoopNet):
    from node.pipeline.stage_server import StageServer

    role = StageServer.__new__(StageServer)
    role.net, role.metrics, role.summary = net, NodeMetrics(), SimpleNamespace(peer_id="me")
    role.averager, role.reachable = SimpleNamespace(tenure=Tenure()), None  # (every record counts: no prober here)
    module = torch.nn.Module()
    module.w, module.b = (torch.nn.Parameter(torch.zeros(s)) for s in SHAPES)
    return role, module


def _stage_records(rounds: dict[str, int]) -> dict[str, SimpleNamespace]:
    return {p: SimpleNamespace(peer_id=p, round=r, role="stage") for p, r in rounds.items()}


def test_a_stage_download_takes_the_replicas_majority(net: LoopNet) -> None:
    from swarm.stages import stage_run

    sub = stage_run("run", 1)
    for peer in ("a", "b"):
        net.serve(peer, HONEST, run_id=sub)
    net.serve("chosen", OTHER, run_id=sub)
    net.serve("ahead", OTHER, round_no=10**9, run_id=sub)
    role, module = _stage_role(net)
    records = _stage_records({"a": ROUND, "b": ROUND, "chosen": ROUND, "ahead": 10**9})
    source = role._download(module, sub, records, adopt=False, prefer="chosen")  # type: ignore[arg-type]
    assert source in ("a", "b")
    assert all(torch.equal(p, t) for p, t in zip(module.parameters(), HONEST["params"]))
    assert net.network.sent.get("ahead", 0) == 0


def test_an_out_of_sync_stage_takes_the_new_round_from_its_source_while_the_others_publish(net: LoopNet) -> None:
    from swarm.stages import stage_run

    sub = stage_run("run", 1)
    for peer in ("a", "b"):
        net.serve(peer, OTHER, round_no=ROUND - 1, run_id=sub)  # not yet published the round just averaged
    net.serve("chosen", HONEST, round_no=ROUND, run_id=sub)
    role, module = _stage_role(net)
    records = _stage_records({"a": ROUND, "b": ROUND, "chosen": ROUND})
    assert role._download(module, sub, records, adopt=False, prefer="chosen", min_round=ROUND) == "chosen"  # type: ignore[arg-type]
    assert all(torch.equal(p, t) for p, t in zip(module.parameters(), HONEST["params"]))
