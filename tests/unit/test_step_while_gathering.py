"""Fast peers step on through a round's rendezvous (``--step-while-gathering``, the default of rounds paced by
time): the round registers first, θ follows once the group is complete.

- ``node.replica.pacing``: every round is due once its budget has run out (a slow peer arrives late, not
  early), and every node with a speed steps on: it registers ``register_lead`` (at least one of its steps)
  ahead of the budget and hands over once it is spent.
- ``gossip.diloco``/``node.replica.rounds``: a round whose θ is handed over after the rendezvous averages the
  θ of the hand-over, not of the start, and its members end bit-identical with a member that did not step on;
  a member that asks for a contribution wakes the owner's rendezvous at once, and has θ handed over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable

import pytest
import torch

import gossip.rendezvous as rendezvous
from node.config import AUTO_STEPS_MAX_FACTOR, NodeConfig
from node.replica.pacing import RoundPacer, register_lead
from protocol.records import RoundEntry
from tests.helpers.diloco_members import diloco_members
from tests.helpers.memory_transport import Network
from tests.helpers.round_runners import with_runners

SHAPES = [(24, 16), (16,), (7, 5)]
TOKENS = 64  # tokens per step
RATE = 640.0  # tokens/s of the median peer: a step is 0.1 s


def _pacer(inner_steps: str | int = "auto") -> RoundPacer:
    pacer = RoundPacer(NodeConfig(inner_steps=inner_steps, round_steps=20), "me")
    pacer.plan(2, RATE, {"other": RATE}, TOKENS, now=0.0)
    return pacer


def test_with_peers_stepping_on_a_round_is_due_only_once_its_budget_has_run_out() -> None:
    pacer = _pacer()
    budget = pacer.pace.budget_s
    assert budget == pytest.approx(20 * TOKENS / RATE)
    step = 0.4  # a slow peer's step
    before = budget - 0.1  # stopping now ends 0.1 s early; another step would end 0.3 s late
    assert pacer.due(5, before, step), "alone, it stops at the nearer end"
    assert not pacer.due(5, before, step, spent=True), "the others step on: it takes the step that runs past the budget"
    assert pacer.due(5, budget, step, spent=True)
    assert pacer.due(pacer.pace.steps, 0.0, step, spent=True), "the cap still ends a round"


def test_a_node_that_steps_on_registers_ahead_of_the_budget_and_hands_over_once_it_is_spent() -> None:
    """Members' rounds start apart (the last round ended apart for each): a node that steps on registers
    ``register_lead`` early, so none who stop at the budget wait for it, and still steps to the budget's end."""
    pacer = _pacer()
    budget = pacer.pace.budget_s
    lead = register_lead(budget)
    assert 0 < lead <= budget / 2
    assert not pacer.due(5, budget - lead - 0.01, 0.1, spent=True, early=True)
    assert pacer.due(5, budget - lead, 0.1, spent=True, early=True)
    assert not pacer.due(5, budget - lead, 0.1, spent=True), "a node that stops at the budget registers when it is spent"
    assert not pacer.spent(budget - 0.01) and pacer.spent(budget)
    provisional = RoundPacer(NodeConfig(inner_steps="auto", round_steps=20), "me")
    provisional.plan(2, 0.0, {}, TOKENS, now=0.0)
    assert provisional.spent(0.0), "before speeds are known there is no budget to wait for"


@pytest.mark.parametrize("budget, step, lead", [(1.0, 0.0, 0.25), (0.4, 0.0, 0.2), (10.0, 0.0, 1.0), (100.0, 0.0, 2.0),
                                               (10.0, 1.5, 1.5), (10.0, 0.5, 1.0), (10.0, 4.0, 2.0), (2.0, 1.5, 1.0)])
def test_the_lead_is_a_share_of_the_budget_or_one_step_within_bounds(budget: float, step: float, lead: float) -> None:
    assert register_lead(budget, step) == pytest.approx(lead)


def test_a_slow_node_registers_a_step_ahead_and_still_hands_over_when_the_budget_is_spent() -> None:
    """A node four times slower than the median (a step of 0.4 s, longer than the 10 % lead of a 2 s budget)
    registers before the step that crosses the budget, so its registration and the others' DHT reads are done
    while it takes that step; it steps on until the budget is spent, as a node that stops at the budget would."""
    pacer = _pacer()
    budget = pacer.pace.budget_s
    step = 0.4
    assert register_lead(budget, step) == pytest.approx(step) and step > register_lead(budget)
    assert not pacer.due(3, budget - step - 0.01, step, spent=True, early=True)
    assert pacer.due(3, budget - step, step, spent=True, early=True)
    assert not pacer.spent(budget - 0.01) and pacer.spent(budget)


def test_a_node_steps_past_its_spent_budget_while_a_much_slower_member_takes_its_last_step() -> None:
    """The group is complete and the budget spent, but a member at least 1.5 × slower is still in the step that crosses
    the budget: this node trains on until that member asks for its update, for at most its rendezvous deadline."""
    pacer = _pacer()
    budget = pacer.pace.budget_s
    deadline = 5.0
    rates = {"me": RATE, "slow": RATE / 4, "fast": 2 * RATE}
    assert pacer.waits_for_slower(budget, RATE, rates, deadline)
    assert pacer.waits_for_slower(budget + deadline - 0.01, RATE, rates, deadline)
    assert not pacer.waits_for_slower(budget + deadline, RATE, rates, deadline), "no longer than a late member is waited for"
    assert pacer.waits_for_slower(budget, RATE, {"me": RATE, "liar": 1e-30}, deadline), "a claimed crawl: still one deadline at most"
    assert not pacer.waits_for_slower(budget, RATE, {"me": RATE, "near": RATE / 1.4, "fast": 2 * RATE}, deadline), \
        "a member less than 1.5 × slower hands over when its budget is spent too"
    assert not pacer.waits_for_slower(budget, RATE, {"me": RATE, "helper": 0.0}, deadline), "a helper announces no speed"
    assert not pacer.waits_for_slower(budget, RATE / 4, rates, deadline), "the slowest member waits for nobody"
    assert not _pacer(inner_steps=20).waits_for_slower(10.0, RATE, rates, deadline), "rounds paced by steps never wait"


@pytest.mark.parametrize("speed", [4.0, 1.0, 0.5, 0.25, 0.01])
def test_every_node_with_a_speed_steps_on_whatever_that_speed(speed: float) -> None:
    assert _pacer().steps_while_gathering(speed * RATE)


def test_a_node_without_a_speed_and_rounds_paced_by_steps_never_step_on() -> None:
    assert not _pacer().steps_while_gathering(0.0)
    assert not _pacer(inner_steps=20).steps_while_gathering(4 * RATE)



def test_in_the_first_round_every_node_that_gets_there_steps_on_up_to_the_cap() -> None:
    """Before speeds are known the first round counts the median's steps: the fast get there first and step
    on (the slowest arrives last), up to the cap of a round paced by time."""
    provisional = RoundPacer(NodeConfig(inner_steps="auto", round_steps=20), "me")
    provisional.plan(2, 0.0, {}, TOKENS, now=0.0)
    assert provisional.provisional and provisional.due(20, 0.0, 0.1)
    assert provisional.steps_while_gathering(RATE / 4) and not provisional.steps_while_gathering(0.0)
    assert provisional.step_cap == 20 * AUTO_STEPS_MAX_FACTOR
    assert _pacer().step_cap == _pacer().pace.steps


def _until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        threading.Event().wait(0.05)


def _ask(a: dict, b: dict) -> concurrent.futures.Future:
    """``b`` asks ``a`` for its contribution to round 0; returns the request once ``a``'s training loop heard of it."""
    async def ask():
        return await asyncio.wait_for(b["exchange"].fetch(a["peer"], 0), 20.0)

    asking = asyncio.run_coroutine_threadsafe(ask(), b["runner"].net.loop)
    _until(a["runner"].waited_for)
    return asking


@pytest.fixture
def members(monkeypatch):
    """Two DiLoCo members (samples 8 and 16, outer η 1, no momentum), each with its own blocking RoundRunner."""
    phi0, members = diloco_members(2, Network(), SHAPES, "none", part_numel=64, seed=5, fetch_timeout=10, serve_timeout=10)
    net = with_runners(monkeypatch, members, eager=False)
    yield phi0, members
    net.close()


def test_a_member_that_steps_on_sends_the_weights_it_hands_over(members) -> None:
    phi0, (a, b) = members
    indices = list(range(len(SHAPES)))
    params_a = [torch.nn.Parameter(t.clone()) for t in a["theta"]]
    a["runner"].start(0, 0, indices, a["phi"], params_a, 0, 3, None, stepping=True)
    assert a["runner"].stepping()
    b_params = [torch.nn.Parameter(t.clone()) for t in b["theta"]]
    b["runner"].start(0, 0, indices, b["phi"], b_params, b["samples"], 10, None)  # a blocking member beside it
    for _ in range(200):  # the fixed group is complete at once
        if a["runner"].gathered():
            break
        threading.Event().wait(0.05)
    assert a["runner"].gathered() and a["runner"].stepping()
    with torch.no_grad():  # the steps taken while the group gathered
        extra = [torch.full_like(p, 0.25) for p in params_a]
        for p, e in zip(params_a, extra):
            p.sub_(e)
    a["runner"].hand_over(params_a, 24, 5)
    assert not a["runner"].stepping()
    result_a, pending_a = a["runner"].wait()
    result_b, _ = b["runner"].wait()
    assert pending_a.steps == 5
    assert result_a.in_sync and result_b.in_sync and result_a.contributors == result_b.contributors == sorted([a["peer"], b["peer"]])
    # what was averaged is the θ of the hand-over (24 samples), not the θ of the start
    delta_a = [d + e for d, e in zip(a["delta"], extra)]
    expected = [p - (24 * da + b["samples"] * db) / (24 + b["samples"]) for p, da, db in zip(phi0, delta_a, b["delta"])]
    for mine, theirs, want in zip(a["phi"], b["phi"], expected):
        assert torch.equal(mine, theirs), "both members hold the same φ, bit for bit"
        assert torch.allclose(mine, want, atol=1e-5), "φ stepped with the mean of the handed-over Δ"
    assert result_a.samples == result_b.samples == 24 + b["samples"]
    assert result_a.gather_s == 0.0, "it stood still for none of the rendezvous"


def test_a_request_for_a_round_not_published_yet_wakes_the_rendezvous(monkeypatch) -> None:
    """gather_group with a 60 s poll: the poke (a member asked for the contribution) brings the next poll forward."""
    registered: dict[str, RoundEntry] = {}

    async def register(dht, validator, run_id, round_no, entry, ttl, group=""):
        registered[entry.peer_id] = entry
        return True

    async def read(dht, run_id, round_no, group="", timeout=3.0):
        return {p: (e, 0.0) for p, e in registered.items()}

    monkeypatch.setattr(rendezvous, "register_round", register)
    monkeypatch.setattr(rendezvous, "read_round_entries", read)

    async def scenario() -> tuple[list[RoundEntry], bool]:
        poke = asyncio.Event()

        async def expected() -> set[str]:
            return {"a", "b"}

        gathering = asyncio.ensure_future(rendezvous.gather_group(
            None, None, "run", 0, RoundEntry(peer_id="a", samples=1, codec="none"), expected, timeout=120.0,  # type: ignore[arg-type]
            poll_interval=60.0, poke=poke))
        await asyncio.sleep(0.5)  # past the first quick polls: the next one would come in a minute
        assert not gathering.done()
        registered["b"] = RoundEntry(peer_id="b", samples=1, codec="none")
        poke.set()  # b found the group complete and asked a for its contribution
        return await asyncio.wait_for(gathering, 20.0)

    group, complete = asyncio.run(scenario())
    assert complete and [e.peer_id for e in group] == ["a", "b"]


def test_the_exchange_reports_every_request_for_a_contribution(members) -> None:
    """The hook that pokes the rendezvous: every fetch of a contribution calls it, of a round published (a member
    that stopped at the budget and published before its rendezvous) or not yet (one that steps on)."""
    _, (a, b) = members
    indices = list(range(len(SHAPES)))
    for m in (a, b):  # a blocking round: both publish round 0
        m["runner"].start(0, 0, indices, m["phi"], [torch.nn.Parameter(t.clone()) for t in m["theta"]], m["samples"], 10, None)
    assert a["runner"].wait()[0].in_sync and b["runner"].wait()[0].in_sync
    asked: list[int] = []
    a["exchange"].asked = asked.append

    async def fetch_published() -> None:
        await asyncio.wait_for(b["exchange"].fetch(a["peer"], 0), 10.0)

    async def fetch_early() -> None:
        with pytest.raises(Exception):
            await asyncio.wait_for(b["exchange"].fetch(a["peer"], 7), 1.0)

    asyncio.run_coroutine_threadsafe(fetch_published(), a["runner"].net.loop).result(20)
    assert asked == [0]
    asyncio.run_coroutine_threadsafe(fetch_early(), a["runner"].net.loop).result(20)
    assert asked == [0, 7]

    async def release() -> None:  # let the waiting request end (refused: nothing published) before the loop closes
        a["exchange"]._ready[7].set()
        await asyncio.sleep(0.2)

    asyncio.run_coroutine_threadsafe(release(), a["runner"].net.loop).result(20)


def test_a_member_asking_for_the_contribution_of_a_round_still_gathering_has_theta_handed_over(members) -> None:
    """A member that found the group complete and asks for this node's contribution waits for it: the training
    loop hears of it (``waited_for``) before this node's own rendezvous has seen the group complete, hands θ over,
    and the contribution is served while that rendezvous still reads the DHT."""
    _, (a, b) = members
    waiting = threading.Event()

    async def slow_to_see(*args, **kwargs):  # this node's rendezvous has not seen the group complete yet
        waiting.set()
        await asyncio.sleep(3600)

    a["averager"]._rendezvous = slow_to_see
    params = [torch.nn.Parameter(t.clone()) for t in a["theta"]]
    a["runner"].start(0, 0, list(range(len(SHAPES))), a["phi"], params, 0, 3, None, stepping=True)
    assert waiting.wait(20), "the round reached its rendezvous"
    assert not a["runner"].waited_for() and not a["runner"].gathered()
    asking = _ask(a, b)
    assert a["runner"].waited_for() and a["runner"].stepping()
    assert not asking.done(), "nothing is served before θ is handed over"
    a["runner"].hand_over(params, 24, 5)
    got = asking.result(20)
    assert got.samples == 24 and got.peer == a["peer"]
    a["runner"].give_up()

    async def settle() -> None:  # let the cancelled round unwind (its rendezvous task too) before the loop closes
        await asyncio.sleep(0.2)

    asyncio.run_coroutine_threadsafe(settle(), a["runner"].net.loop).result(20)


def test_a_member_asking_once_the_group_is_complete_has_theta_handed_over_by_a_node_still_stepping(members) -> None:
    """A node whose group is complete steps on while a much slower member takes its last step
    (``RoundPacer.waits_for_slower``, from the speeds of the group's entries); that member's request for the
    contribution, sent once it has handed its own θ over, reaches the training loop (``waited_for``) though this
    node's rendezvous is over."""
    _, (a, b) = members
    group = [RoundEntry(peer_id=p, samples=1, codec="none", tokens_per_s=r) for p, r in sorted([(a["peer"], RATE), (b["peer"], RATE / 4)])]

    async def complete(rnd):  # the group is complete at once
        return group

    async def nobody_else(*args, **kwargs):  # (b never runs the round: a averages alone once it has its θ)
        return {}, {}

    a["averager"]._rendezvous = complete
    a["exchange"].gather = nobody_else
    params = [torch.nn.Parameter(t.clone()) for t in a["theta"]]
    a["runner"].start(0, 0, list(range(len(SHAPES))), a["phi"], params, 0, 3, None, stepping=True)
    _until(a["runner"].gathered)
    assert a["runner"].gathered() and a["runner"].stepping() and not a["runner"].waited_for()
    assert a["runner"].group_rates() == {a["peer"]: RATE, b["peer"]: RATE / 4}
    asking = _ask(a, b)
    assert a["runner"].waited_for() and a["runner"].stepping()
    a["runner"].hand_over(params, 24, 5)
    got = asking.result(20)
    assert got.samples == 24 and got.peer == a["peer"]
    result, pending = a["runner"].wait()
    assert pending.steps == 5 and result.samples == 24


def test_a_round_still_gathering_when_the_node_stops_is_given_up(members) -> None:
    """A signal while the round gathers: the node does not hand θ over and wait out the round (up to its final
    timeout, minutes), it cancels it, as a blocking round is cancelled."""
    _, (a, _) = members

    waiting = threading.Event()

    async def never(*args, **kwargs):
        waiting.set()
        await asyncio.sleep(3600)

    a["averager"]._rendezvous = never  # a group that never completes
    params = [torch.nn.Parameter(t.clone()) for t in a["theta"]]
    pending = a["runner"].start(0, 0, list(range(len(SHAPES))), a["phi"], params, 0, 3, None, stepping=True)
    assert waiting.wait(20), "the round reached its rendezvous"
    assert a["runner"].stepping() and not a["runner"].gathered()
    a["runner"].give_up()
    assert a["runner"].pending is None and not a["runner"].stepping()
    for _ in range(100):
        if pending.future.done():
            break
        threading.Event().wait(0.05)
    assert pending.future.cancelled()

    async def settle() -> None:  # let the cancelled round unwind (its rendezvous task too) before the loop closes
        await asyncio.sleep(0.2)

    asyncio.run_coroutine_threadsafe(settle(), a["runner"].net.loop).result(20)


def test_slowdown_does_not_multiply_a_stalled_step() -> None:
    """``--slowdown`` sleeps (s − 1) × each step; a step stalled far past the typical one (a process paused
    mid-step) counts as ``STALL_FACTOR`` typical steps, so a 12 s pause does not add a minute of sleep."""
    from node.replica.pacing import STALL_FACTOR, slowdown_sleep

    assert slowdown_sleep(1.0, 0.5, 0.1) == 0.0
    assert slowdown_sleep(3.0, 0.1, 0.0) == 0.2000000000000000  # nothing typical yet: the step as it is
    assert abs(slowdown_sleep(3.0, 0.12, 0.1) - 0.24) < 1e-12
    assert abs(slowdown_sleep(6.0, 12.0, 0.015) - 5 * STALL_FACTOR * 0.015) < 1e-12
