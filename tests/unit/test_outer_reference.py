"""Outer optimizers stepped against their formulas (ALGORITHMS.md) over several rounds, and their limits at the edges.

Exact float64 references of Nesterov/heavy-ball SGD with warm-up and of NoLoCo's step, the hyperparameter
checks at their boundaries (what is allowed and what is refused, with the message), and the state a
checkpoint or joiner takes: fp32 host copies that the optimizer does not share.
"""

from __future__ import annotations

import pytest
import torch

from gossip.outer import NesterovOuter, NoLoCoOuter

D = torch.float64


def _deltas(rounds: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(5, generator=g, dtype=D), torch.randn(2, 2, generator=g, dtype=D)] for _ in range(rounds)]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("warmup", [0, 3])
def test_nesterov_outer_follows_its_formula_for_several_rounds(nesterov: bool, warmup: int) -> None:
    lr, mu = 0.7, 0.9
    outer = NesterovOuter(lr=lr, momentum=mu, nesterov=nesterov, warmup_rounds=warmup)
    phi = [torch.zeros(5), torch.zeros(2, 2)]
    ref_phi, ref_v = [torch.zeros(5, dtype=D), torch.zeros(2, 2, dtype=D)], [torch.zeros(5, dtype=D), torch.zeros(2, 2, dtype=D)]
    for r, delta in enumerate(_deltas(5)):
        eta = lr * min(1.0, (r + 1) / warmup) if warmup else lr
        assert outer.lr_at(r) == pytest.approx(eta)
        preview = outer.preview(phi, [d.float() for d in delta], round_no=r)
        outer.step(phi, [d.float() for d in delta], round_no=r)
        for i, d in enumerate(delta):
            ref_v[i] = mu * ref_v[i] + d
            ref_phi[i] = ref_phi[i] - eta * ((d + mu * ref_v[i]) if nesterov else ref_v[i])
            torch.testing.assert_close(phi[i].double(), ref_phi[i], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(preview[i], phi[i], rtol=1e-6, atol=1e-7)  # the preview is the step
    assert outer.lr_at(None) == lr and outer.lr_at(-4) == pytest.approx(lr / warmup if warmup else lr)


def test_a_preview_leaves_momentum_and_weights_untouched() -> None:
    outer = NesterovOuter(lr=0.5, momentum=0.5)
    phi = [torch.ones(3)]
    outer.step(phi, [torch.ones(3)])
    before_phi, before_v = phi[0].clone(), outer.buffers[0].clone()
    outer.preview(phi, [torch.full((3,), 4.0)])
    assert torch.equal(phi[0], before_phi) and torch.equal(outer.buffers[0], before_v)


@pytest.mark.parametrize("kwargs", [dict(lr=0.0), dict(lr=-1.0), dict(momentum=1.0), dict(momentum=-0.1), dict(warmup_rounds=-1)])
def test_nesterov_outer_refuses_settings_outside_its_range(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"outer lr must be > 0, momentum in \[0, 1\) and warm-up rounds ≥ 0, got lr="):
        NesterovOuter(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-6), dict(lr=0.5), dict(lr=2.0), dict(momentum=0.0), dict(momentum=0.999),
                                    dict(warmup_rounds=0), dict(warmup_rounds=1)])
def test_nesterov_outer_accepts_the_edges_of_its_range(kwargs: dict) -> None:
    NesterovOuter(**kwargs)


def test_noloco_defaults_and_the_pull_that_follows_the_lr() -> None:
    outer = NoLoCoOuter()
    assert (outer.lr, outer.pull, outer.momentum) == (0.7, 0.7, 0.5)
    assert NoLoCoOuter(lr=0.3).pull == 0.3  # γ defaults to β
    assert NoLoCoOuter(lr=0.3, pull=0.0).pull == 0.0  # an explicit γ is kept, 0 included
    assert NoLoCoOuter(lr=0.3, pull=1.2).pull == 1.2


@pytest.mark.parametrize("kwargs", [dict(lr=0.0), dict(lr=-0.5), dict(pull=-0.1), dict(momentum=1.0), dict(momentum=-0.5)])
def test_noloco_refuses_settings_outside_its_range(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"NoLoCo needs β > 0, γ ≥ 0 and α in \[0, 1\), got β="):
        NoLoCoOuter(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-6), dict(lr=0.5), dict(pull=0.0), dict(pull=0.5), dict(momentum=0.0), dict(momentum=0.99)])
def test_noloco_accepts_the_edges_of_its_range(kwargs: dict) -> None:
    NoLoCoOuter(**kwargs)


def test_noloco_follows_its_formula_for_several_rounds() -> None:
    beta, gamma, alpha = 0.6, 0.4, 0.5
    outer = NoLoCoOuter(lr=beta, pull=gamma, momentum=alpha)
    phi = [torch.zeros(5), torch.zeros(2, 2)]
    ref_phi = [torch.zeros(5, dtype=D), torch.zeros(2, 2, dtype=D)]
    ref_d = [torch.zeros(5, dtype=D), torch.zeros(2, 2, dtype=D)]
    for mean_phi, progress in zip(_deltas(4, seed=1), _deltas(4, seed=2)):
        outer.step(phi, [t.float() for t in mean_phi], [t.float() for t in progress])
        for i in range(2):
            ref_d[i] = alpha * ref_d[i] + beta * progress[i] + gamma * (mean_phi[i] - ref_phi[i])
            ref_phi[i] = ref_phi[i] + ref_d[i]
            torch.testing.assert_close(phi[i].double(), ref_phi[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [NesterovOuter, NoLoCoOuter])
def test_state_tensors_are_fp32_host_copies_with_zeros_for_untouched_parameters(make) -> None:
    outer = make()
    like = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)]
    if make is NesterovOuter:
        outer.step(like, [torch.ones(3, dtype=torch.bfloat16), torch.ones(2)], indices=None)
    else:
        outer.step(like, [torch.ones(3), torch.ones(2)], [torch.ones(3), torch.ones(2)])
    outer.buffers.pop(1)  # parameter 1 never stepped
    state = outer.state_tensors(like)
    assert [t.dtype for t in state] == [torch.float32, torch.float32] and all(t.device.type == "cpu" for t in state)
    assert torch.equal(state[1], torch.zeros(2)) and state[1].shape == (2,)
    state[0].add_(100.0)  # a copy: the optimizer's buffer is not the checkpoint's tensor
    assert not torch.equal(outer.buffers[0], state[0])
    loaded = make()
    half = [t.to(torch.bfloat16) for t in outer.state_tensors(like)]
    loaded.load_state_tensors(half)
    assert all(b.dtype == torch.float32 for b in loaded.buffers.values())
    half[0].add_(1.0)  # loading copies too
    assert not torch.equal(loaded.buffers[0], half[0].float())


def test_nesterov_defaults_and_a_warm_up_counted_from_the_first_round() -> None:
    outer = NesterovOuter()
    assert (outer.lr, outer.momentum, outer.nesterov, outer.warmup_rounds, outer.first_round) == (0.7, 0.9, True, 0, 0)
    late = NesterovOuter(lr=1.0, warmup_rounds=4, first_round=10)
    assert [late.lr_at(r) for r in (8, 10, 11, 13, 20)] == [0.25, 0.25, 0.5, 1.0, 1.0]


def test_indices_must_match_the_tensors() -> None:
    with pytest.raises(ValueError, match="2 tensors but 1 parameter indices"):
        NesterovOuter().step([torch.zeros(1), torch.zeros(1)], [torch.zeros(1), torch.zeros(1)], indices=[0])


def test_buffers_follow_the_parameters_device_and_checkpoints_are_fp32_whatever_the_default_dtype() -> None:
    outer = NesterovOuter()
    outer.step([torch.zeros(3)], [torch.ones(3)])
    cpu_buffer = outer._buffer(0, torch.zeros(3))
    assert cpu_buffer is outer.buffers[0]  # same device: the buffer itself, not a copy
    moved = outer._buffer(0, torch.zeros(3, device="meta"))  # another device (a GPU's, where there is one)
    assert moved.device.type == "meta" and outer.buffers[0].device.type == "meta"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert NesterovOuter().state_tensors([torch.zeros(2)])[0].dtype == torch.float32
    finally:
        torch.set_default_dtype(previous)
