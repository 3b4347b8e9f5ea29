"""Bounds on the tensors pipeline peers send each other (``swarm.plausible``), on both sides of a call."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from protocol.tensors import tensor_to_wire
from swarm.microbatch import PipelineClient
from swarm.plausible import RATIO, WARMUP, ScaleCheck, rms
from swarm.router import Router
from swarm.service import encode_activation
from tests.unit.test_swarm_units import CFG, _ask, _service


def test_a_tensor_far_off_the_recent_scale_is_refused_and_not_remembered():
    check = ScaleCheck("stage 1's input activations")
    g = torch.Generator().manual_seed(0)
    for _ in range(WARMUP):
        assert check.check(torch.randn(4, 8, generator=g)) is None
    assert check.check(torch.randn(4, 8, generator=g) * 0.5 * RATIO) is None, "within the bound"
    why = check.check(torch.randn(4, 8, generator=g) * 3 * RATIO)
    assert why is not None and why.startswith("stage 1's input activations has RMS") and f"refused beyond {RATIO:g}×" in why
    assert check.refused == 1 and len(check.recent) == WARMUP + 1, "a refused tensor does not move the median"
    assert check.check(torch.zeros(0)) is None and rms(torch.zeros(0)) == 0.0


def test_nothing_is_refused_before_the_warmup_and_slow_drift_always_passes():
    check = ScaleCheck("activations")
    assert check.check(torch.full((3,), 1e9)) is None, "nothing to compare with yet"
    drifting = ScaleCheck("activations")
    for step in range(300):  # 30× over 300 steps, as stage 0's output grew in nano: never refused
        assert drifting.check(torch.full((8,), 0.04 * 30 ** (step / 299))) is None


def test_a_scale_that_changed_for_good_is_learnt_anew_but_one_honest_answer_ends_a_streak():
    check = ScaleCheck("stage 1's activations")
    for i in range(WARMUP):
        check.check(torch.ones(4), "ab"[i % 2])
    for i in range(WARMUP - 1):
        assert check.check(torch.full((4,), 1e4), "ab"[i % 2]) is not None
    assert check.check(torch.ones(4), "a") is None, "an honest answer in between"
    for i in range(WARMUP - 1):
        assert check.check(torch.full((4,), 1e4), "ab"[i % 2]) is not None, "the streak started over"
    assert check.check(torch.full((4,), 1e4), "b") is not None and not check.recent, "the eighth refusal in a row resets"
    assert check.check(torch.full((4,), 1e4), "a") is None, "the new scale is learnt"


def test_one_client_alone_cannot_switch_a_shared_check_off():
    """A stage server's check is shared by every client: refusals of one liar, however many in a row, never
    reset it (they used to after 8, and the liar's next 8 tensors set the new median)."""
    check = ScaleCheck("stage 1's input activations")
    for i in range(WARMUP):
        check.check(torch.ones(4), "ab"[i % 2])
    for _ in range(10 * WARMUP):
        assert check.check(torch.full((4,), 1e4), "liar") is not None
    assert check.limit() == pytest.approx(RATIO), "the honest clients' scale still bounds"
    # a liar that first played honest is one source of three: still not enough
    check.check(torch.ones(4), "liar")
    for _ in range(10 * WARMUP):
        assert check.check(torch.full((4,), 1e4), "liar") is not None
    assert check.limit() == pytest.approx(RATIO)


def test_a_gradient_over_the_bound_is_scaled_down_to_it_and_the_bound_remembered():
    check = ScaleCheck("stage 0's output gradient")
    for _ in range(WARMUP):
        t, factor = check.clip(torch.ones(10))
        assert factor == 1.0 and torch.equal(t, torch.ones(10))
    huge = torch.full((10,), 1e6)
    t, factor = check.clip(huge)
    assert factor == pytest.approx(RATIO / 1e6) and rms(t) == pytest.approx(RATIO) and check.clipped == 1
    assert torch.equal(huge, torch.full((10,), 1e6)), "the caller's tensor is not changed in place"
    assert max(check.recent) == pytest.approx(RATIO), "the median moves by the clipped scale, not the sent one"


@pytest.mark.parametrize("bad", [{"ratio": 1.0}, {"window": 0}, {"warmup": 0}])
def test_a_check_without_a_sensible_bound_is_refused(bad):
    with pytest.raises(ValueError, match="ratio > 1"):
        ScaleCheck("x", **bad)


def test_a_stage_server_refuses_to_step_on_huge_activations_and_bounds_huge_gradients():
    async def go():
        first, last = _service(0), _service(1)
        tasks = [asyncio.get_running_loop().create_task(s._consume()) for s in (first, last)]
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (2, 8), generator=g)
        for _ in range(WARMUP):
            h = torch.randn(2, 8, CFG.d_model, generator=g)
            kind, body = await _ask(last, "loss", {"stage": 1, "x": encode_activation(h, "none"), "y": tensor_to_wire(tokens)})
            assert kind == "loss", body
            kind, _ = await _ask(first, "backward", {"stage": 0, "x": tensor_to_wire(tokens), "grad": encode_activation(0.01 * h, "none")})
            assert kind == "grad"
        steps = last.worker().steps
        huge = torch.randn(2, 8, CFG.d_model, generator=g) * 1e4
        kind, body = await _ask(last, "loss", {"stage": 1, "x": encode_activation(huge, "none"), "y": tensor_to_wire(tokens)})
        assert kind == "refused" and "this stage does not step on it" in body["message"] and "input activations" in body["message"]
        assert last.worker().steps == steps and last.refused_implausible == 1

        steps = first.worker().steps
        kind, _ = await _ask(first, "backward", {"stage": 0, "x": tensor_to_wire(tokens), "grad": encode_activation(1e4 * huge, "none")})
        assert kind == "grad" and first.worker().steps == steps + 1, "a huge gradient is bounded, then stepped on"
        assert first.clipped_gradients == 1 and first.refused_implausible == 0
        assert all(math.isfinite(float(p.detach().norm())) for p in first.worker().parameters())
        for t in tasks:
            t.cancel()

    asyncio.run(go())


def test_a_trainer_refuses_answers_of_the_wrong_shape_scale_or_loss():
    client = PipelineClient(None, "run", 2, Router(), d_model=CFG.d_model)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 8), generator=g)
    h = torch.randn(2, 8, CFG.d_model, generator=g)
    for _ in range(WARMUP):
        assert client._answer_problem(0, "forward", x, {"y": torch.randn(2, 8, CFG.d_model, generator=g)}, {}) is None
    assert "shape [2, 8, 3]" in client._answer_problem(0, "forward", x, {"y": torch.zeros(2, 8, 3)}, {})
    assert "shape [2, 7, 64]" in client._answer_problem(0, "forward", x, {"y": torch.zeros(2, 7, CFG.d_model)}, {})
    assert "refused beyond" in client._answer_problem(0, "forward", x, {"y": h * 1e4}, {})
    assert client._answer_problem(0, "forward", x, {"y": h * 2}, {}) is None
    assert "gradient of shape [2, 8]" in client._answer_problem(1, "loss", h, {"loss": 3.0, "g": torch.zeros(2, 8)}, {})
    assert "a loss of nan" in client._answer_problem(1, "loss", h, {"loss": float("nan"), "g": torch.zeros_like(h)}, {})
    assert client._answer_problem(1, "evaluate", h, {"loss": float("nan")}, {}) is None, "a diverged model's evaluation is reported"
    assert client._answer_problem(0, "backward", x, {"g": None}, {}) is None, "stage 0 returns no gradient for tokens"
