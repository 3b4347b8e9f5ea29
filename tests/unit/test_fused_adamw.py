"""The inner AdamW runs torch's fused kernel on the CPU too: it equals the per-tensor loop up to float
rounding, and a state dict written by either form loads into the other without turning the kernel off."""

from __future__ import annotations

import copy

import torch

from swarm.inner_optimizer import build_inner_optimizer, fused_supported
from swarm.models.presets import build_model, preset


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(preset("nano"))


def _train(model: torch.nn.Module, optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        optimizer.step()


def test_the_cpu_default_is_fused_and_matches_the_per_tensor_loop():
    fused_model, loop_model = _model(), _model()
    fused = build_inner_optimizer(fused_model.named_parameters(), "adamw", 1e-3, 0.1)
    loop = build_inner_optimizer(loop_model.named_parameters(), "adamw", 1e-3, 0.1, fused=False)
    assert all(g["fused"] for g in fused.param_groups) and not any(g["fused"] for g in loop.param_groups)
    _train(fused_model, fused, 20)
    _train(loop_model, loop, 20)
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_loop_written_state_resumes_fused_and_steps_alike():
    source = _model()
    loop = build_inner_optimizer(source.named_parameters(), "adamw", 1e-3, 0.1, fused=False)
    _train(source, loop, 5)
    state = loop.state_dict()

    resumed_model, reference_model = _model(), _model()
    resumed_model.load_state_dict(source.state_dict())
    reference_model.load_state_dict(source.state_dict())
    resumed = build_inner_optimizer(resumed_model.named_parameters(), "adamw", 1e-3, 0.1)
    reference = build_inner_optimizer(reference_model.named_parameters(), "adamw", 1e-3, 0.1, fused=False)
    resumed.load_state_dict(copy.deepcopy(state))  # torch shares the step counters with the dict it loads
    reference.load_state_dict(copy.deepcopy(state))
    assert all(g["fused"] for g in resumed.param_groups)  # torch's own load would restore fused=False
    _train(resumed_model, resumed, 5, seed=2)
    _train(reference_model, reference, 5, seed=2)
    for a, b in zip(resumed_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_fused_kernel_is_only_asked_for_where_torch_has_one():
    assert fused_supported([torch.zeros(2)])
    assert not fused_supported([torch.zeros(2, dtype=torch.int64)])
    assert not fused_supported([torch.zeros(2, device="meta")])
    assert not fused_supported([])
