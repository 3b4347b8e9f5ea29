"""One-byte zeroth-order steps (``gossip.zo``, ``gossip.zo_exchange``): seeds, codec, exact
perturbation, order-free application, relays and log replay — without daemons."""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gossip import zo
from gossip.fingerprint import fingerprint
from gossip.zo_exchange import Applied, CodeExchange, CodeSet, LogEntry, Position, ReplayError, members_digest, replay
from protocol.errors import ProtocolError
from swarm.models.presets import GPT, preset
from tests.helpers.memory_transport import Network

SHAPES = [(300, 7), (5,), (70_000,), (3, 4, 5)]  # 70 000 values span two blocks of 65 536
_DIGEST = """
import hashlib, sys, torch
from gossip import zo
torch.set_num_threads(int(sys.argv[1]))
h = hashlib.sha256()
for seed in (0, 1, zo.step_seed("run", 3, 7, "peer")):
    for z in zo.direction({shapes}, seed):
        h.update(z.numpy().tobytes())
print(h.hexdigest())
"""


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run beside busy daemons: one torch thread each (restored afterwards)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _digest(threads: int) -> str:
    torch.set_num_threads(threads)
    h = hashlib.sha256()
    for seed in (0, 1, zo.step_seed("run", 3, 7, "peer")):
        for z in zo.direction(SHAPES, seed):
            h.update(z.numpy().tobytes())
    torch.set_num_threads(1)
    return h.hexdigest()


# ---- seeds and directions -----------------------------------------------------------------------
def test_seeds_are_63_bit_and_differ_by_run_round_step_and_peer():
    seeds = {zo.step_seed(run, r, t, p) for run in ("a", "b") for r in (0, 1) for t in (0, 1) for p in ("x", "y")}
    assert len(seeds) == 16 and all(0 <= s < 2**63 for s in seeds)
    assert zo.step_seed("a", 1, 2, "x") == zo.step_seed("a", 1, 2, "x")


def test_directions_are_bit_identical_in_another_process_with_other_threads():
    code = _DIGEST.format(shapes=SHAPES)
    other = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True, timeout=120, check=True)
    assert other.stdout.strip() == _digest(2)


def test_a_block_regenerates_alone_and_directions_look_standard_normal():
    whole = zo.direction(SHAPES, 42)
    blocks = list(zo.z_blocks(SHAPES, 42))
    assert [(i, start) for i, start, _ in blocks] == [(0, 0), (1, 0), (2, 0), (2, 65536), (3, 0)]
    for i, start, z in blocks:
        assert torch.equal(whole[i].reshape(-1)[start:start + z.numel()], z)
    flat = torch.cat([z.reshape(-1) for z in whole])
    assert abs(float(flat.mean())) < 0.02 and abs(float(flat.std()) - 1) < 0.02
    assert not torch.equal(zo.direction(SHAPES, 43)[2], whole[2])


# ---- the one-byte code --------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=math.exp((0.51 + zo.CODE_OFFSET) / 16), max_value=math.exp((127.49 + zo.CODE_OFFSET) / 16)),
       st.sampled_from([1.0, -1.0]))
def test_the_byte_keeps_the_sign_and_3_percent_inside_its_range(magnitude, sign):
    g = sign * magnitude
    code = zo.encode_grad(g)
    assert -127 <= code <= 127 and code != 0 and (code > 0) == (g > 0)
    assert abs(zo.decode_grad(code) / g - 1) <= math.exp(1 / 32) - 1 + 1e-6


def test_the_byte_round_trips_every_code_and_handles_the_edges():
    for code in range(-127, 128):
        assert zo.encode_grad(zo.decode_grad(code)) == code
    assert zo.encode_grad(0.0) == 0 and zo.decode_grad(0) == 0.0
    assert zo.encode_grad(float("nan")) == 0 and zo.encode_grad(float("inf")) == 0
    assert zo.encode_grad(1e-9) == 0 and zo.encode_grad(-1e-9) == 0  # below the smallest level: no step
    assert zo.encode_grad(1e9) == 127 and zo.encode_grad(-1e9) == -127  # saturates
    blob = zo.pack_codes([0, 1, -1, 127, -127])
    assert len(blob) == 5 and zo.unpack_codes(blob) == [0, 1, -1, 127, -127]
    with pytest.raises(ValueError):
        zo.unpack_codes(b"\x80")
    with pytest.raises(ValueError):
        zo.decode_grad(128)


# ---- exact perturbation -------------------------------------------------------------------------
def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(preset("nano")).eval()
    with torch.no_grad():  # weights of every scale, exact zeros included (the biases)
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(torch.logspace(-3, 1, p.shape[-1]))
    return model


def test_two_evaluations_leave_the_weights_bit_identical():
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    x = torch.randint(0, 256, (2, 16))
    losses = []
    for step in range(5):
        g, plus, minus = zo.spsa_estimate(lambda: model(x, x)[1], params, zo.step_seed("run", 0, step, "me"), 1e-3)
        assert math.isfinite(g) and plus != minus
        losses.append(g)
        assert all(torch.equal(a, b) for a, b in zip(params, before)), "θ must come back bit for bit"
    # a plain θ + εz − 2εz + εz would not: float32 sums round differently
    naive = [p.clone() for p in before]
    for i, start, z in zo.z_blocks([p.shape for p in naive], 1):
        part, e = naive[i].view(-1)[start:start + z.numel()], z * 1e-3
        part.add_(e).sub_(2 * e).add_(e)
    assert not all(torch.equal(a, b) for a, b in zip(naive, before))


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_failing_evaluation_still_restores_the_weights(fail_at):
    model = _model()
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    calls = []

    def loss() -> float:
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("out of memory")
        return 1.0

    with pytest.raises(RuntimeError):
        zo.spsa_estimate(loss, params, 5, 1e-3)
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_steps_against_the_estimated_gradient_lower_the_loss():
    torch.manual_seed(0)
    w, target = torch.zeros(50), torch.randn(50)
    loss = lambda: float((w - target).pow(2).mean())  # noqa: E731
    start = loss()
    for t in range(100):
        g, _, _ = zo.spsa_estimate(loss, [w], zo.step_seed("run", 0, t, "me"), 1e-3)
        zo.apply_codes([w], [zo.StepCode(0, t, "me", zo.encode_grad(g))], "run", 0.5)
    assert loss() < 0.5 * start


# ---- order-free application ---------------------------------------------------------------------
def _messages(rounds: int = 2, peers: tuple[str, ...] = ("a", "b", "c"), steps: int = 4) -> list[zo.StepCode]:
    rng = random.Random(1)
    return [zo.StepCode(r, t, p, rng.choice([c for c in range(-127, 128) if c])) for r in range(rounds) for p in peers for t in range(steps)]


def test_replicas_stay_identical_when_codes_arrive_late_twice_and_out_of_order():
    torch.manual_seed(0)
    start = [torch.randn(40, 30), torch.randn(70_000)]
    messages = _messages()
    first, second = [t.clone() for t in start], [t.clone() for t in start]
    zo.apply_codes(first, messages, "run", 1e-3)
    rng = random.Random(7)
    shuffled = messages[len(messages) // 2:] + messages * 2  # the second half first, everything twice
    rng.shuffle(shuffled)
    late = shuffled[:5]  # ... and five of them once more at the very end
    assert zo.apply_codes(second, shuffled + late, "run", 1e-3) == len(messages)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], start[0])
    # arrival order alone (no sorting) would give other bits
    naive = [t.clone() for t in start]
    for m in shuffled:
        zo.apply_codes(naive, [m], "run", 1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(first, naive))
    with pytest.raises(ValueError, match="two codes"):
        zo.agreed_order([zo.StepCode(0, 0, "a", 3), zo.StepCode(0, 0, "a", 4)])


def test_a_seed_pool_draws_only_its_k_seeds_and_its_scalars_rebuild_the_fine_tune():
    pool = 8
    seeds = {zo.step_seed("run", r, t, p, pool) for r in range(4) for t in range(30) for p in ("a", "b", "c")}
    assert seeds == {zo.pool_seed("run", k) for k in range(pool)}  # every entry used, nothing else
    assert zo.pool_seed("run", 0) != zo.pool_seed("other", 0)
    torch.manual_seed(0)
    start = [torch.randn(40, 30), torch.randn(70_000)]
    messages = _messages(rounds=3)
    stepped = [t.clone() for t in start]
    zo.apply_codes(stepped, messages, "run", 1e-3, pool=pool)
    scalars = zo.pool_scalars(messages, "run", 1e-3, pool)
    assert len(scalars) == pool and sum(a != 0 for a in scalars) > 1
    rebuilt = [t.clone() for t in start]
    zo.apply_pool_scalars(rebuilt, scalars, "run")
    moved = max(float((a - b).abs().max()) for a, b in zip(stepped, start))
    assert moved > 1e-3
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(stepped, rebuilt))  # float32 rounding only
    plain = [t.clone() for t in start]
    zo.apply_codes(plain, messages, "run", 1e-3)  # without the pool: other directions
    assert not torch.equal(plain[0], stepped[0])


def test_the_majority_fingerprint_and_its_tie_break_are_the_same_everywhere():
    assert zo.majority({"a": "x", "b": "y", "c": "y"}, 4, "a") == ("y", "c")
    tie = {"b": "y", "a": "x"}
    assert zo.majority(tie, 4, "a") == zo.majority(tie, 4, "b"), "a tie goes the same way at every member"


# ---- the exchange: relays and log replay (in-memory transport) -----------------------------------
def _exchanges(names: list[str], position: dict[str, Position]) -> tuple[Network, dict[str, CodeExchange]]:
    net = Network()
    out = {n: CodeExchange(net.transport(n), "run", lambda n=n: position[n], {"zo_lr": 1e-3}, serve_timeout=2) for n in names}
    return net, out


def test_codes_a_member_could_not_fetch_are_relayed_by_another_member():
    async def go():
        position = {n: Position(0, 4, "00" * 12) for n in "abc"}
        net, ex = _exchanges(list("abc"), position)
        for ex_ in ex.values():
            await ex_.start()
        sets = {n: CodeSet(n, 0, "00" * 12, zo.pack_codes([i + 1, -1, 0, 5])) for i, n in enumerate("abc")}
        for n, s in sets.items():
            await ex[n].publish(s)
        got_b = await ex["b"].gather(["a", "c"], 0, 2)  # b reaches everyone
        net.down.add("c")  # now c's link to a breaks
        got_a = await ex["a"].gather(["b", "c"], 0, 2)
        assert got_b.sets == {"a": sets["a"], "c": sets["c"]} and not got_b.failures
        assert got_a.sets == {"b": sets["b"], "c": sets["c"]} and got_a.failures == {"c": "relayed"}
        # b applied round 0 with a's and b's codes and moved on: a member still in round 0 learns whom
        # b applied (a digest) and where it got, to take b's round instead of its own view if they differ
        ex["b"].record(LogEntry(0, "00" * 12, "11" * 12, (sets["a"], sets["b"])), snapshot_round=0)
        position["b"] = Position(1, 0, "11" * 12)
        late = await ex["c"].gather(["b"], 0, 2)
        assert late.ahead == {"b": Applied(1, members_digest(["b", "a"]), "11" * 12)} and late.sets == {"b": sets["b"]}
        assert members_digest(["a", "b"]) != members_digest(["a", "b", "c"])
        net.down.add("b")  # nobody holds c's codes for round 1: c is left out
        await ex["a"].publish(CodeSet("a", 1, "00" * 12, b"\x01"))
        got = await ex["a"].gather(["b", "c"], 1, 1)
        assert got.sets == {} and set(got.failures) == {"b", "c"}
        assert ex["b"].served[0] == {"a", "c"} and ex["c"].served[0] == {"b"}, "c's codes reached a through b"

    asyncio.run(go())


def test_a_joiner_replays_the_log_from_a_lagging_snapshot_and_equals_the_others():
    run, lr, peers = "run", 1e-3, ["a", "b"]
    torch.manual_seed(0)
    model = GPT(preset("nano")).eval()
    replicas = {p: [t.detach().clone() for t in model.parameters()] for p in peers}
    x = torch.randint(0, 256, (2, 16))
    log: list[LogEntry] = []
    snapshot = None
    for r in range(5):
        if r == 2:  # the snapshot a joiner downloads lags three rounds behind
            snapshot = [t.clone() for t in replicas["a"]]
        before = fingerprint(replicas["a"])
        sets = []
        for p in peers:
            with torch.no_grad():
                for dst, src in zip(model.parameters(), replicas[p]):
                    dst.copy_(src)
            codes = []
            for t in range(3):
                g, _, _ = zo.spsa_estimate(lambda: model(x, x)[1], list(model.parameters()), zo.step_seed(run, r, t, p), 1e-3)
                codes.append(zo.encode_grad(g))
            sets.append(CodeSet(p, r, before, zo.pack_codes(codes)))
        for p in reversed(peers):  # each replica applies the round in its own arrival order
            arrived = [m for s in (sets if p == "a" else sets[::-1]) for m in zo.expand(r, s.peer, s.codes)]
            zo.apply_codes(replicas[p], arrived, run, lr)
        assert fingerprint(replicas["a"]) == fingerprint(replicas["b"])
        log.append(LogEntry(r, before, fingerprint(replicas["a"]), tuple(sets)))

    async def serve_log():
        position = {"a": Position(5, 0, fingerprint(replicas["a"])), "j": Position(0, 0, "")}
        net, ex = _exchanges(["a", "j"], position)
        await ex["a"].start()
        for entry in log:
            ex["a"].record(entry, snapshot_round=2)
        assert [e.round for e in ex["a"].entries_from(0, 5)] == [0, 1, 2, 3, 4]
        return await ex["j"].fetch_log("a", 2)

    reply = asyncio.run(serve_log())
    assert [e.round for e in reply.entries] == [2, 3, 4] and reply.meta == {"zo_lr": 1e-3}
    joiner = [t.clone() for t in snapshot]
    applied = list(replay(joiner, reply.entries, 2, fingerprint(joiner), run, lr))
    assert [e.round for e in applied] == [2, 3, 4]
    assert fingerprint(joiner) == reply.position.fingerprint == fingerprint(replicas["b"])
    assert all(torch.equal(a, b) for a, b in zip(joiner, replicas["a"]))
    stale = [t.clone() for t in snapshot]  # weights that are not the log's: refused, not silently mixed
    stale[0].add_(1e-3)
    with pytest.raises(ReplayError, match="does not continue"):
        list(replay(stale, reply.entries, 2, fingerprint(stale), run, lr))


def test_refused_requests_name_the_problem():
    async def go():
        position = {"a": Position(10, 0, "00" * 12), "b": Position(10, 0, "00" * 12)}
        _, ex = _exchanges(["a", "b"], position)
        await ex["a"].start()
        for round_no, needle in ((-1, "not served"), (19, "not served"), (10, "no codes for round 10")):
            with pytest.raises(ProtocolError, match=needle):
                await ex["b"].fetch("a", round_no)
        assert await ex["b"].fetch("a", 3) == ([], Applied(10, None, None)), "a member past the round: its round"

    asyncio.run(go())


# ---- --init-from --------------------------------------------------------------------------------
def test_init_from_takes_a_checkpoints_weights_and_names_every_mistake(tmp_path):
    from node.checkpoints.checkpoint import save_atomic
    from node.config import load_config
    from node.errors import UserError
    from node.runtime.workload import load_init_weights

    nano = preset("nano")
    weights = [p.detach().clone() for p in GPT(nano).parameters()]
    path = save_atomic({"model_config": nano.to_dict(), "phi": weights, "theta": [w + 1 for w in weights], "round": 3},
                       tmp_path / "run" / "checkpoint.pt")
    for where in (path, path.parent):  # the file or its --checkpoint-dir
        got, file = load_init_weights(where, nano)
        assert file == path and all(torch.equal(a, b) for a, b in zip(got, weights)), "phi, the agreed weights"
    with pytest.raises(UserError, match="invalid configuration: --init-from: .*does not exist"):
        load_config({"algorithm": "zo", "init_from": tmp_path / "nowhere.pt"})
    (tmp_path / "empty").mkdir()
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    for where, needle in ((tmp_path / "empty", "no checkpoint at"), (garbage, "not a readable locomesh checkpoint")):
        with pytest.raises(UserError, match=needle):
            load_init_weights(where, nano)
    with pytest.raises(UserError, match="holds a nano model, not this one; pass --model nano"):
        load_init_weights(path, preset("tiny"))
