"""Pipeline pieces without a network: stages, the stage worker and service, routing, rebalancing, roles."""

import asyncio
import math
import random
import struct

import pytest
import torch

from node.ops.launcher import pipeline_role
from swarm.models.presets import GPT, preset
from swarm.stage_map import choose_role, refreshed_records
from protocol.errors import SchemaError
from protocol.frames import decode_message, read_frame
from protocol.records import PeerRecord
from protocol.tensors import tensor_to_wire
from swarm.rebalance import pipeline_throughput, plan_move
from swarm.router import NoPeerAvailable, Router
from swarm.service import StageService, decode_activation, encode_activation
from swarm.stages import Stage, block_range
from swarm.stage_worker import StageWorker
from tests.helpers.memory_transport import canned_stream, ended_reader, frames

CFG = preset("nano")


def test_block_ranges_cover_the_model_in_order():
    for layers in range(1, 9):
        for count in range(1, layers + 1):
            ranges = [block_range(layers, i, count) for i in range(count)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1
    with pytest.raises(ValueError, match="cannot cut"):
        block_range(2, 0, 3)


def test_stages_compose_to_the_single_process_model_at_init():
    torch.manual_seed(5)
    full = GPT(CFG)
    stages = [Stage(CFG, i, 2, seed=5) for i in range(2)]
    x = torch.randint(0, 256, (3, 16))
    with torch.no_grad():
        expected, _ = full(x)
        got = stages[1](stages[0](x))
    torch.testing.assert_close(got, expected)
    replica = Stage(CFG, 0, 2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(replica.parameters(), stages[0].parameters())), "replicas start identical"


def test_a_pipeline_of_workers_learns():
    """Two stage workers chained in-process the way trainers chain stage servers."""
    torch.manual_seed(0)
    workers = [StageWorker(Stage(CFG, i, 2, seed=1), torch.device("cpu"), lr=3e-3, warmup_steps=5) for i in range(2)]
    text = torch.tensor(list(b"to be or not to be, that is the question. " * 40))
    losses = []
    for step in range(40):
        starts = torch.randint(0, len(text) - 33, (8,))
        x = torch.stack([text[s : s + 32] for s in starts])
        y = torch.stack([text[s + 1 : s + 33] for s in starts])
        h = workers[0].forward(x)
        loss, grad = workers[1].loss_step(h, y)
        assert grad is not None and grad.shape == h.shape
        assert workers[0].backward(x, grad) is None  # stage 0 has no input gradient
        losses.append(loss)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    assert workers[0].steps == workers[1].steps == 40 and workers[0].last_grad_norm > 0


# ---- the stage service's validation -------------------------------------------------------------
async def _ask(service: StageService, kind: str, body: dict) -> tuple[str, dict]:
    stream, sink = canned_stream(frames((kind, {"run_id": "run", **body})))
    try:
        await service._handle(stream)
    except SchemaError as e:
        return "refused", {"message": str(e)}
    msg = decode_message(await read_frame(ended_reader(bytes(sink.data))))
    return msg.kind, msg.body


def _service(stage_index: int) -> StageService:
    worker = StageWorker(Stage(CFG, stage_index, 2, seed=1), torch.device("cpu"))
    service = StageService(None, "run", lambda: worker, codec="none")  # type: ignore[arg-type]
    service.queue = asyncio.Queue(service.queue_limit)
    return service


def test_stage_service_answers_valid_requests_and_refuses_bad_ones():
    async def go():
        first, last = _service(0), _service(1)
        tasks = [asyncio.get_running_loop().create_task(s._consume()) for s in (first, last)]
        tokens = torch.randint(0, 256, (2, 8))
        kind, body = await _ask(first, "forward", {"stage": 0, "x": tensor_to_wire(tokens)})
        assert kind == "activation"
        h = decode_activation(body["y"], "none", (2, 8, CFG.d_model), 1 << 20)
        kind, body = await _ask(last, "loss", {"stage": 1, "x": encode_activation(h, "none"), "y": tensor_to_wire(tokens)})
        assert kind == "loss" and math.isfinite(body["loss"]) and body["g"] is not None

        nan = encode_activation(h, "none").replace(struct.pack("<f", float(h.flatten()[0])), struct.pack("<f", float("nan")), 1)
        bad = {
            "serves stage 0 now": (first, "forward", {"stage": 1, "x": tensor_to_wire(tokens)}),
            "out of the vocabulary": (first, "forward", {"stage": 0, "x": tensor_to_wire(tokens + 300)}),
            "NaN": (last, "loss", {"stage": 1, "x": nan, "y": tensor_to_wire(tokens)}),
            "takes activations": (last, "loss", {"stage": 1, "x": encode_activation(torch.zeros(2, 8, 3), "none"), "y": tensor_to_wire(tokens)}),
            "holds no embeddings": (last, "forward", {"stage": 1, "x": tensor_to_wire(tokens), "embed": True}),
            "must be booleans": (first, "forward", {"stage": 0, "x": tensor_to_wire(tokens), "embed": 1}),
            "go to the last stage": (first, "loss", {"stage": 0, "x": tensor_to_wire(tokens), "y": tensor_to_wire(tokens)}),
            "codec payload": (last, "backward", {"stage": 1, "x": [1, 2, 3]}),
        }
        for needle, (service, kind, body) in bad.items():
            answer, detail = await _ask(service, kind, body)
            assert answer == "refused" and needle in detail["message"], (needle, detail)
        for t in tasks:
            t.cancel()

    asyncio.run(go())


def test_a_full_queue_answers_busy_instead_of_waiting():
    async def go():
        service = _service(0)
        for _ in range(service.queue_limit):
            service.queue.put_nowait(object())  # no consumer: the queue stays full
        kind, body = await _ask(service, "forward", {"stage": 0, "x": tensor_to_wire(torch.zeros(1, 4, dtype=torch.int64))})
        assert kind == "error" and body["code"] == "busy" and "another replica" in body["message"]

    asyncio.run(go())


def test_int8_activations_are_four_times_smaller():
    h = torch.randn(8, 64, 64)
    dense, small = encode_activation(h, "none"), encode_activation(h, "int8-block")
    assert len(small) < len(dense) / 3.5
    back = decode_activation(small, "int8-block", tuple(h.shape), 1 << 20)
    assert float((back - h).norm() / h.norm()) < 0.02


# ---- routing ------------------------------------------------------------------------------------
def test_router_shares_follow_throughput_three_to_one():
    router = Router(seed=1)
    router.update(0, {"fast": 3.0, "slow": 1.0})
    counts = {"fast": 0, "slow": 0}
    for _ in range(4000):
        counts[router.choose(0)] += 1
    assert counts["fast"] / counts["slow"] == pytest.approx(3.0, rel=0.05)


def test_router_new_peer_enters_at_the_minimum_and_failures_are_banned():
    now = [0.0]
    router = Router(seed=2, ban_s=10.0, clock=lambda: now[0])
    router.update(0, {"a": 1.0, "b": 1.0})
    for _ in range(100):
        router.choose(0)
    router.update(0, {"a": 1.0, "b": 1.0, "c": 0.0})  # joins, unmeasured: counts as the median peer
    picks = [router.choose(0) for _ in range(30)]
    assert 8 <= picks.count("c") <= 12, "a newcomer takes its fair share, no flood and no starvation"
    router.ban("a")
    assert "a" not in {router.choose(0) for _ in range(20)}
    now[0] = 11.0
    assert "a" in {router.choose(0) for _ in range(20)}, "a ban ends when the peer's record would have expired"
    router.update(0, {"b": 1.0})
    assert router.peers(0) == ["b"]
    router.ban("b")
    with pytest.raises(NoPeerAvailable, match="stage 0"):
        router.choose(0)


def test_a_starved_replica_with_a_stale_estimate_gets_work_again():
    now = [0.0]
    router = Router(seed=3, clock=lambda: now[0])
    # the slow replica measured itself on a few early steps and the router then never chose it again
    router.update(0, {"starved": 9_368.0, "busy": 400_000.0})
    picks = [router.choose(0) for _ in range(800)]
    assert picks.count("starved") >= 0.25 * 400 * 0.5, "never below a quarter of the median's share"
    for second in range(1, 40):  # the busy server keeps re-measuring; the starved one's number never moves
        now[0] = float(second)
        router.update(0, {"starved": 9_368.0, "busy": 400_000.0 + second})
    picks = [router.choose(0) for _ in range(800)]
    assert picks.count("starved") >= 0.25 * 400, "a stale estimate counts as the median: at least a quarter of a fair share"
    router.update(0, {"starved": 9_500.0, "busy": 400_040.0})  # re-measured: its own number counts again
    assert router.throughput["starved"] == 0.25 * 400_040.0


def test_a_refused_task_is_refunded_so_a_busy_replica_is_not_starved_later():
    router = Router(seed=4)
    router.update(0, {"a": 1.0, "b": 1.0})
    for _ in range(50):  # "a" answers busy fifty times: each try is charged, then taken back
        peer = router.choose(0, 4.0, exclude=["b"])
        router.refund(0, peer, 4.0)
    picks = [router.choose(0) for _ in range(100)]
    assert picks.count("a") == 50, "refused tries leave no phantom load behind"


def test_a_replica_charged_at_an_outdated_estimate_is_not_starved_once_estimates_change():
    router = Router(seed=5)
    router.update(0, {"a": 10.0, "b": 10.0})  # both still warming up: 10 samples/s
    picks = [router.choose(0, 8.0) for _ in range(3)]  # one of them is charged a second slow task (0.8)
    ahead = max(set(picks), key=picks.count)
    router.update(0, {"a": 24_000.0, "b": 30_000.0})  # warmed up: a task now costs ~0.0003
    picks = [router.choose(0, 8.0) for _ in range(200)]
    # without the bound the one ahead would wait ~2,400 tasks to be chosen again
    assert picks.count(ahead) >= 80, "shares follow the current estimates, not a charge made at the old ones"


def test_missing_roles_name_what_a_short_pipeline_needs():
    from protocol.records import PeerRecord
    from swarm.stage_map import missing_roles

    def rec(peer: str, role: str, stage: int = -1) -> PeerRecord:
        return PeerRecord(peer_id=peer, role=role, stage=stage)

    full = [rec("a", "stage", 0), rec("b", "stage", 1), rec("c", "stage", 2), rec("t", "trainer")]
    assert missing_roles(full, 3) == []
    assert missing_roles(full[1:], 3) == ["a server for stage 0"]
    assert missing_roles(full[1:] + [rec("s", "spare")], 3) == [], "a spare will take it"
    assert missing_roles(full[1:] + [rec("b2", "stage", 1)], 3) == [], "a second stage-1 server can move"
    assert missing_roles(full[:3], 3) == ["a trainer"]


# ---- rebalancing ----------------------------------------------------------------------------------
def _simulate(stages: list[dict[str, float]], rounds: int = 5) -> tuple[list[float], int]:
    """Every peer runs plan_move each period, as stage servers do; returns throughput per period and moves."""
    history, moves = [pipeline_throughput(stages)], 0
    for _ in range(rounds):
        plans = {p: plan_move(stages, p) for s in stages for p in s}
        for peer, target in plans.items():
            if target is not None:
                source = next(i for i, s in enumerate(stages) if peer in s)
                stages[target][peer] = stages[source].pop(peer)
                moves += 1
        history.append(pipeline_throughput(stages))
    return history, moves


def test_rebalancing_moves_a_peer_to_the_bottleneck_and_throughput_rises():
    stages = [{"a": 10.0, "b": 10.0, "c": 10.0}, {"d": 10.0}, {"e": 10.0, "f": 10.0}]
    history, moves = _simulate(stages)
    assert history[-1] > history[0] and history[-1] == 20.0
    assert moves == 1 and len(stages[1]) == 2, "exactly one peer moved, into the bottleneck"


def test_a_balanced_swarm_does_not_move_anyone():
    stages = [{"a": 10.0, "b": 10.0}, {"c": 9.5, "d": 10.0}, {"e": 10.0, "f": 10.5}]
    history, moves = _simulate(stages)
    assert moves == 0 and history[0] == history[-1]


def test_random_swarms_never_lose_throughput_or_empty_a_stage():
    rng = random.Random(3)
    for _ in range(200):
        stages = [{f"s{s}p{i}": rng.uniform(1, 10) for i in range(rng.randint(1, 4))} for s in range(rng.randint(2, 5))]
        history, _ = _simulate(stages, rounds=6)
        assert all(b >= a for a, b in zip(history, history[1:]))
        assert all(stages)


# ---- roles --------------------------------------------------------------------------------------
def _rec(peer: str, role: str, stage: int = -1, tps: float = 100.0) -> PeerRecord:
    return PeerRecord(peer_id=peer, role=role, stage=stage, tokens_per_s=tps)


def test_auto_role_fills_empty_stages_then_trainers_then_the_weakest_stage():
    assert choose_role([], 2) == 0
    assert choose_role([_rec("a", "stage", 0)], 2) == 1
    assert choose_role([_rec("a", "stage", 0), _rec("b", "stage", 1)], 2) is None  # a trainer next
    three = [_rec("a", "stage", 0, 50), _rec("b", "stage", 1, 200), _rec("t", "trainer")]
    assert choose_role(three, 2) == 0  # the stage with the least throughput


def test_a_killed_servers_lingering_record_does_not_count_for_the_role_choice():
    st0, st1, trainer = _rec("st0", "stage", 0), _rec("st1", "stage", 1), _rec("t", "trainer")
    first = {"st0": (st0, 100.0), "st1": (st1, 100.5)}
    second = {"st0": (st0, 100.0), "st1": (st1, 102.5), "t": (trainer, 103.0)}  # st0 stopped re-announcing
    live = refreshed_records(first, second)
    assert [r.peer_id for r in live] == ["st1", "t"]
    assert choose_role(live, 2) == 0  # the emptied stage, not a second trainer
    assert choose_role([st0, st1], 2) is None  # what the stale read made of it: a trainer


def test_local_swarm_roles():
    assert [pipeline_role(i, 6, 2) for i in range(6)] == [0, 1, 0, 1, None, None]
    assert [pipeline_role(i, 3, 2) for i in range(3)] == [0, 1, None]


def test_a_claim_is_bounded_by_the_rate_the_router_measured_from_that_peer():
    """A peer announcing far more than its stage but answering slowly draws a share by its measured speed, not its word."""
    from swarm.router import MAX_MULTIPLE_OF_MEDIAN, MAX_MULTIPLE_OF_OBSERVED, MIN_OBSERVATIONS

    router = Router(seed=3)
    claims = {"honest-a": 1000.0, "honest-b": 1000.0, "liar": 1e30}

    def answers(n: int) -> None:
        for _ in range(n):
            router.observe("liar", 256.0, 2.56)  # 100 tokens/s as seen from here
            for peer in ("honest-a", "honest-b"):
                router.observe(peer, 256.0, 0.512)  # 500 tokens/s from here (queueing and network included)

    router.update(0, claims)
    answers(MIN_OBSERVATIONS - 1)
    router.update(0, claims)
    assert router.throughput["liar"] == MAX_MULTIPLE_OF_MEDIAN * 1000.0, "too few answers to bound a claim yet"
    answers(1)
    router.update(0, claims)
    assert router.throughput["liar"] == pytest.approx(MAX_MULTIPLE_OF_OBSERVED * 100.0)
    assert router.throughput["honest-a"] == 1000.0, "an honest claim within the slack is taken as announced"
    picks = [router.choose(0) for _ in range(1400)]
    assert picks.count("liar") == pytest.approx(1400 * 800 / 2800, abs=5)  # was 64,000 / 66,000 of the work
    router.update(0, {"honest-a": 1000.0, "honest-b": 1000.0})  # a peer that left is forgotten, its measurements too
    assert "liar" not in router.observed


def test_stage_throughput_counts_each_microbatch_once_over_all_its_compute():
    service = _service(0)
    service._observe(0, 0.1)  # a forward: time, no finished microbatch yet
    assert service.throughput == 0, "unmeasured until a microbatch finishes here"
    for _ in range(50):
        service._observe(0, 0.1)  # forward
        service._observe(8, 0.3)  # backward of the same 8 samples
    assert service.throughput == pytest.approx(8 / 0.4, rel=0.05)


def test_an_absurd_throughput_claim_is_capped_at_a_multiple_of_the_lower_median():
    from swarm.router import MAX_MULTIPLE_OF_MEDIAN


    router = Router(seed=5)
    router.update(0, {"honest": 1000.0, "liar": 1e30})
    assert router.throughput["liar"] == MAX_MULTIPLE_OF_MEDIAN * 1000.0
    picks = [router.choose(0) for _ in range(650)]
    assert picks.count("honest") >= 5, "the honest replica keeps a share"
    # --role auto: one server of stage 0 claiming 1e30 does not make stage 0 look the best served
    records = [PeerRecord(peer_id="s0", role="stage", stage=0, tokens_per_s=1e30),
               PeerRecord(peer_id="s0b", role="stage", stage=0, tokens_per_s=100.0),
               *(PeerRecord(peer_id=f"s1-{i}", role="stage", stage=1, tokens_per_s=100.0) for i in range(70)),
               *(PeerRecord(peer_id=f"t{i}", role="trainer") for i in range(3))]
    assert choose_role(records, 2) == 0, "stage 0 counts 64 × 100 + 100 tokens/s at most, less than stage 1's 7000"


def test_free_ports_come_from_below_the_ephemeral_range_and_are_bindable() -> None:
    import socket

    from node.ops.launcher import _ephemeral_low, free_port

    for _ in range(20):
        port = free_port()
        assert 0 < port < 65536
        if _ephemeral_low() > 12000:
            assert port < _ephemeral_low()  # where a p2pd on tcp/0 cannot take it in the meantime
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
