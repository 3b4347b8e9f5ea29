"""A replica far slower than the others helps instead of training (``--helper-below``, ``node.replica.paced_rounds``):
when it switches, what it announces, when it arrives, and the round it joins with 0 samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.config import NodeConfig
from node.replica.node import Daemon
from node.replica.pacing import RoundPacer, should_help


def _daemon(**overrides) -> Daemon:
    d = Daemon(NodeConfig(model="nano", batch_size=4, device="cpu", threads=1, **overrides))
    d._prepare()
    d.summary.peer_id = "me"
    return d


def test_only_a_node_under_the_share_of_the_others_median_helps() -> None:
    rates = {"me": 50.0, "a": 1000.0, "b": 1000.0, "c": 10.0}
    assert should_help(50.0, rates, "me", 0.1)  # the median of the others is 1000: 50 is under 100
    assert not should_help(150.0, rates, "me", 0.1)
    assert not should_help(50.0, rates, "me", 0.0)  # --helper-below 0: always train
    assert not should_help(0.0, rates, "me", 0.1)  # no speed of its own yet
    assert not should_help(50.0, {"me": 50.0}, "me", 0.1)  # nobody to compare with
    assert not should_help(50.0, {"me": 50.0, "h": 0.0}, "me", 0.1)  # helpers announce no speed
    # one liar announcing 1e30 moves the median by one rank: it cannot push an honest peer out alone
    assert not should_help(500.0, {"me": 500.0, "a": 1000.0, "b": 1000.0, "liar": 1e30}, "me", 0.1)


def test_a_helper_arrives_when_the_others_budget_ends_and_announces_no_speed() -> None:
    pacer = RoundPacer(NodeConfig(round_steps=40), "me")
    pace = pacer.plan_helper(3, {"me": 10.0, "a": 1000.0, "b": 1000.0}, 100, now=5.0, fallback_rate=10.0)
    assert pace.steps == 0 and pace.expected_steps == 0 and pace.budget_s == pytest.approx(4.0)
    assert not pacer.helper_due(8.9) and pacer.helper_due(9.0)
    # the trainers plan the same budget from the same entries (the helper's own speed left out of the median)
    trainers = {"a": 1000.0, "b": 1000.0}
    assert RoundPacer(NodeConfig(round_steps=40), "a").plan(3, 1000.0, trainers, 100, 5.0, shared=True).budget_s == pytest.approx(4.0)
    alone = pacer.plan_helper(3, {"me": 0.0}, 100, now=0.0, fallback_rate=0.0)
    assert alone.budget_s is None and pacer.helper_due(0.0)  # no speed known at all: it does not wait


def test_two_slow_rounds_in_a_row_make_a_daemon_a_helper_that_joins_rounds_with_no_samples() -> None:
    d = _daemon(helper_below=0.1)
    d.compute_tokens_per_s = 20.0
    d.round_rates = {"me": 20.0, "a": 1000.0, "b": 900.0}
    d._consider_helping()
    assert not d.helping and d.slow_rounds == 1
    d.round_rates = {"me": 20.0, "a": 1000.0, "b": 2000.0}
    d._consider_helping()
    assert d.helping and d.summary.role == "helper" and d._announced_rate() == 0.0
    d.averager = SimpleNamespace(scorer=None)  # the network is not started here
    assert d._record_fields()["tokens_per_s"] == 0.0 and d._status_fields()["helping"]
    d._plan_round(start=0.0)
    assert d.pacer.pace.steps == 0 and d.pacer.pace.budget_s is not None

    started = []
    d._start_round = lambda samples: started.append((samples, d.inner_step))  # the round itself: gossip.diloco's tests
    d._finish_pending = lambda final=False: None
    d.pacer.pace = d.pacer.pace.__class__(0, 0.0, 0.0, 0, 40)  # due at once
    before = d.summary.steps
    d._help_round()
    assert started == [(0, 0)] and d.summary.steps == before and d.helped_steps == 40


def test_a_fast_round_in_between_resets_the_count_and_a_fixed_h_never_helps() -> None:
    d = _daemon(helper_below=0.1)
    d.compute_tokens_per_s = 20.0
    d.round_rates = {"me": 20.0, "a": 1000.0}
    d._consider_helping()
    d.compute_tokens_per_s = 500.0
    d._consider_helping()
    d.compute_tokens_per_s = 20.0
    d._consider_helping()
    assert not d.helping and d.slow_rounds == 1
    fixed = _daemon(inner_steps=10)
    fixed.compute_tokens_per_s = 20.0
    fixed.round_rates = {"me": 20.0, "a": 1000.0}
    for _ in range(3):
        fixed._consider_helping()
    assert not fixed.helping


def test_max_steps_counts_the_rounds_a_helper_sat_in() -> None:
    d = _daemon(helper_below=0.1, max_steps=100)
    d.helping, d.helped_steps = True, 99
    assert not d._deadline_reached()
    d.helped_steps = 100
    assert d._deadline_reached()
