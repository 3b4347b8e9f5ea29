"""How a replica paces its rounds (``node.replica.pacing``). DiLoCo's and SparseLoCo's default,
``--inner-steps auto``: a round is the time the swarm's median-speed peer takes for the by-replicas table's H
(the replicas of the last round; before any round, the trainers it sees), and each peer takes the steps that
fit. ``--inner-steps by-replicas`` gives every peer that H in steps, and a number given stays what it says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from node.config import AUTO_STEPS_MAX_FACTOR, BY_REPLICAS, NodeConfig, steps_for_replicas
from node.config.defaults import STEPS_BY_REPLICAS
from node.replica.node import Daemon
from node.replica.pacing import RoundPacer


def test_the_table_gives_every_replica_count_one_h() -> None:
    assert [steps_for_replicas(n) for n in (1, 2, 4)] == [50] * 3
    assert [steps_for_replicas(n) for n in (5, 8, 32, 10_000)] == [30] * 4
    for algorithm, table in STEPS_BY_REPLICAS.items():
        assert table[-1][0] is None  # any count has a row
        assert [steps_for_replicas(n, algorithm) for n in range(1, 40)] == sorted((steps_for_replicas(n, algorithm) for n in range(1, 40)), reverse=True)


def _daemon(**overrides) -> Daemon:
    d = Daemon(NodeConfig(model="nano", batch_size=4, device="cpu", threads=1, **overrides))
    d._prepare()
    d.summary.peer_id = "me"
    return d


def _sees_trainers(d: Daemon, others: int, rate: float = 1000.0) -> None:
    d.peer_rates = {"me": rate, **{f"peer-{i}": rate for i in range(others)}}


def _planned(d: Daemon):
    d._plan_round()
    return d.pacer.pace


def test_diloco_and_sparseloco_pace_rounds_by_time_by_default_others_by_steps() -> None:
    for algorithm in STEPS_BY_REPLICAS:
        cfg = NodeConfig(algorithm=algorithm)
        assert cfg.inner_steps == "auto" and cfg.round_steps is None
    assert NodeConfig(algorithm="noloco").inner_steps == 30


@pytest.mark.parametrize("fragments, per_round", [(1, (50, 30)), (2, (25, 15))])
@pytest.mark.parametrize("mode", ["auto", BY_REPLICAS])
def test_a_replica_sizes_its_round_from_the_replicas_that_averaged_last(mode: str, fragments: int, per_round: tuple[int, int]) -> None:
    d = _daemon(fragments=fragments, inner_steps=mode)
    d.compute_tokens_per_s = 1000.0
    assert _planned(d).median_steps == per_round[0]  # alone so far
    _sees_trainers(d, 5)
    assert _planned(d).median_steps == per_round[1]  # six trainers in the records, no round yet
    d.last_contributors = 3  # the last round's members count, not the records (which anyone can add to)
    assert _planned(d).median_steps == per_round[0]
    d.last_contributors = 8
    pace = _planned(d)
    assert pace.median_steps == per_round[1]
    if mode == BY_REPLICAS:
        assert (pace.steps, pace.budget_s) == (per_round[1], None)
    else:  # every peer at the same speed: the budget is the median's H at that speed
        tokens_per_step = 4 * d.trainer.model.cfg.context
        assert pace.budget_s == pytest.approx(per_round[1] * tokens_per_step / 1000.0)
        assert pace.expected_steps == per_round[1] and pace.steps == per_round[1] * AUTO_STEPS_MAX_FACTOR


def test_a_number_of_steps_given_is_kept_whatever_the_swarm() -> None:
    d = _daemon(inner_steps=40)
    d.compute_tokens_per_s = 50.0
    _sees_trainers(d, 9)
    d.last_contributors = 10
    assert (_planned(d).steps, _planned(d).budget_s) == (40, None)


def test_sparseloco_sizes_its_rounds_from_its_own_table() -> None:
    d = _daemon(algorithm="sparseloco")
    d.last_contributors = 2
    assert _planned(d).median_steps == steps_for_replicas(2, "sparseloco")
    d.last_contributors = 8
    assert _planned(d).median_steps == steps_for_replicas(8, "sparseloco")


def test_the_first_round_counts_the_median_steps_until_this_node_has_a_speed() -> None:
    d = _daemon()
    pace = _planned(d)
    assert pace.budget_s is None and pace.steps == steps_for_replicas(1) and d.pacer.provisional
    # once it has a speed (and sees others'), the rest of that round is paced by time from the same start
    d.compute_tokens_per_s = 1000.0
    _sees_trainers(d, 2, rate=500.0)
    d._plan_round(start=pace.started)
    assert not d.pacer.provisional and d.pacer.pace.started == pace.started and d.pacer.pace.budget_s is not None
    assert not RoundPacer(NodeConfig(inner_steps=30), "x").provisional


def test_a_claimed_rate_of_1e30_cannot_shrink_the_budget_to_one_step() -> None:
    d = _daemon(round_steps=50)
    d.compute_tokens_per_s = 1000.0
    _sees_trainers(d, 2)
    honest = _planned(d).budget_s
    d.peer_rates["liar"] = 1e30  # one liar among three: the median moves by one rank at most
    assert _planned(d).budget_s == honest
    d.peer_rates = {"me": 1000.0, "liar": 1e30}  # alone with the liar: bounded by the clip of 20x
    assert _planned(d).budget_s >= honest / 11
    assert _planned(d).expected_steps >= 50 // 11 > 1


def _run_round(pacer: RoundPacer, step_times: list[float], now: float = 0.0, steps: int = 0) -> tuple[int, float]:
    """Steps one simulated peer has taken (step i lasts ``step_times[min(i, last)]`` s) when the round is due."""
    while True:
        step_s = step_times[min(steps, len(step_times) - 1)]
        now += step_s
        steps += 1
        if pacer.due(steps, now, step_s):
            return steps, now


@settings(max_examples=200, deadline=None)
@given(speeds=st.lists(st.floats(0.25, 4.0), min_size=1, max_size=8), median_steps=st.integers(1, 60))
def test_peers_of_any_speed_end_a_round_within_half_a_step_of_the_budget(speeds: list[float], median_steps: int) -> None:
    """Every peer plans the same budget (the median's H at the median speed) from the same records (speeds
    within the clip's factor of each other), and ends within half of its own step of it."""
    cfg = NodeConfig(round_steps=median_steps)
    rates = {f"p{i}": 1000.0 * s for i, s in enumerate(speeds)}
    ends = []
    for peer, rate in rates.items():
        pacer = RoundPacer(cfg, peer)
        pace = pacer.plan(len(rates), rate, rates, 100, now=0.0)
        step_s = 100 / rate
        steps, end = _run_round(pacer, [step_s])
        if steps < pace.steps and pace.budget_s > step_s:  # neither the sample cap nor the one-step floor stopped it
            assert abs(end - pace.budget_s) <= step_s / 2 + 1e-9
        ends.append(pace.budget_s)
    assert max(ends) == pytest.approx(min(ends))


def test_a_peer_that_slows_down_mid_round_takes_fewer_steps_and_still_ends_on_time() -> None:
    cfg = NodeConfig(round_steps=40)
    rates = {"a": 1000.0, "b": 1000.0, "c": 1000.0}
    pacer = RoundPacer(cfg, "a")
    pace = pacer.plan(3, 1000.0, rates, 100, now=0.0)
    steps, end = _run_round(pacer, [0.1] * 10 + [0.35])  # 3.5x slower after 10 steps (a game started)
    assert pace.budget_s == pytest.approx(4.0)
    assert steps == 10 + 9 and abs(end - pace.budget_s) <= 0.35 / 2


def test_a_joiner_runs_what_is_left_of_the_round_it_took_over() -> None:
    pacer = RoundPacer(NodeConfig(round_steps=40), "a")
    pace = pacer.plan(2, 1000.0, {"a": 1000.0, "b": 1000.0}, 100, now=100.0)
    pacer.resume_at(30, now=100.0)
    steps, end = _run_round(pacer, [0.1], now=100.0, steps=30)
    assert steps == 40 and end - 100.0 == pytest.approx(pace.budget_s / 4)


def test_members_of_a_round_plan_the_next_from_its_entries_alike_whatever_they_measured_since() -> None:
    """Each member's own speed moves between rounds (a busy CPU, a game): planned from the records and its own
    measurement, members' budgets differed by ~10 % (a fast peer waited up to 1.3 s a round in the
    heterogeneous benchmark); planned from the last round's entries, which every member holds alike, they agree."""
    cfg = NodeConfig(round_steps=50)
    entries = {"a": 1000.0, "b": 950.0, "c": 500.0, "d": 250.0}
    own_now = {"a": 1100.0, "b": 800.0, "c": 520.0, "d": 240.0}
    shared = {p: RoundPacer(cfg, p).plan(4, own_now[p], entries, 100, 0.0, shared=True).budget_s for p in entries}
    assert max(shared.values()) == pytest.approx(min(shared.values()))
    apart = {p: RoundPacer(cfg, p).plan(4, own_now[p], entries, 100, 0.0).budget_s for p in entries}
    assert max(apart.values()) > 1.05 * min(apart.values())


def test_a_node_announces_its_speed_in_its_round_entry_and_plans_from_the_round_it_was_in() -> None:
    from protocol.records import RoundEntry
    from protocol.errors import SchemaError

    entry = RoundEntry("p", 8, "none", tokens_per_s=1234.5)
    assert RoundEntry.from_value(entry.to_value()) == entry
    assert RoundEntry.from_value({"peer_id": "p", "samples": 8, "codec": "none"}).tokens_per_s == 0.0  # an older peer's
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(SchemaError):
            RoundEntry.from_value({**entry.to_value(), "tokens_per_s": bad})
    d = _daemon()
    d.compute_tokens_per_s = 1000.0
    d.round_rates = {"me": 1000.0, "x": 500.0, "y": 500.0}
    assert _planned(d).budget_s == pytest.approx(50 * 4 * d.trainer.model.cfg.context / 500.0)


@pytest.mark.parametrize("inner_steps", [5, "auto"])
def test_an_overlapped_node_steps_on_while_the_round_before_it_still_runs(inner_steps) -> None:
    """With ``--overlap`` a node whose round is due while the one before it still runs takes more steps instead of
    standing still, up to twice the round's planned steps; ``delayed`` overlap keeps its exact one-round delay."""
    import concurrent.futures
    import time

    from node.replica.rounds import PendingRound, RoundRunner

    d = _daemon(overlap=True, inner_steps=inner_steps, round_steps=5)
    d.compute_tokens_per_s = 1000.0
    d._plan_round(start=time.monotonic() - 1e3)  # (paced by time: the budget has run out)
    planned = d.pacer.pace.expected_steps
    in_flight: concurrent.futures.Future = concurrent.futures.Future()
    d.rounds = RoundRunner(net=None, averager=None, eager=False, before_gather=None, stop=d.stop, final_timeout=1.0)  # type: ignore[arg-type]
    d.rounds.pending = PendingRound(0, 0, planned, in_flight)
    d.inner_step = planned
    assert d._round_due(0.001) and d._steps_on_past_due()
    d.inner_step = 2 * planned - 1
    assert d._steps_on_past_due()
    d.inner_step = 2 * planned
    assert not d._steps_on_past_due(), "at twice the planned steps it waits for the round"
    d.inner_step = planned
    d.cfg.overlap_mode = "delayed"
    assert not d._steps_on_past_due()
    d.cfg.overlap_mode = "asap"
    d.summary.steps = d.cfg.max_steps = 3
    assert not d._steps_on_past_due(), "at the node's deadline the steps so far go into a last round"
    d.cfg.max_steps = None
    in_flight.set_result(None)
    assert not d._steps_on_past_due(), "the round before is done: the next one starts"
    d.overlapping = False
    d.rounds.pending = PendingRound(0, 0, planned, concurrent.futures.Future())
    assert not d._steps_on_past_due(), "a blocking round waits"
