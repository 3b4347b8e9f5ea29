"""The memory estimate of ``node join`` (node/ops/memory.py): what each setting changes, and the suggestions of a refusal.

Against real training: tests/integration/test_memory.py.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from node.config import load_config
from node.ops import memory
from node.ops.memory import architecture, estimate, refusal

GIB = 1 << 30


def est(free_ram: int = 64 * GIB, device: str = "cpu", free_vram: int | None = None, **flags: Any) -> memory.Estimate:
    cfg = load_config(flags, None)
    return estimate(cfg, architecture(cfg), device, (free_ram, free_vram), vram_total=free_vram or 0)


def part(e: memory.Estimate, name: str) -> memory.Row:
    (row,) = [r for r in e.rows if r.what.startswith(name)]
    return row


def test_activations_shrink_with_micro_batches_and_checkpointing() -> None:
    full = part(est(model="small", batch_size=16), "activations").nbytes
    micro = part(est(model="small", batch_size=16, micro_batch_size=4), "activations").nbytes
    ckpt = part(est(model="small", batch_size=16, activation_checkpointing=True), "activations").nbytes
    assert micro < full / 3 and ckpt < full / 2
    assert part(est(model="small", context=512), "activations").nbytes > 1.9 * part(est(model="small"), "activations").nbytes


def test_parameters_and_states_scale_with_the_model() -> None:
    small, medium = est(model="small"), est(model="medium")
    for name in ("model parameters", "gradients", "inner optimizer", "outer state"):
        assert part(medium, name).nbytes > 7 * part(small, name).nbytes
    assert part(small, "inner optimizer").nbytes == 2 * part(small, "model parameters").nbytes  # AdamW: two states


def test_outer_state_follows_outer_device_and_codec_adds_a_residual() -> None:
    on_gpu = est(device="cuda", free_vram=80 * GIB, model="small", outer_device="same")
    assert part(on_gpu, "outer state").where == "VRAM" and part(on_gpu, "model parameters").where == "VRAM"
    assert part(est(device="cuda", free_vram=80 * GIB, model="small"), "outer state").where == "RAM"
    assert not [r for r in est(model="small").rows if r.what.startswith("error-feedback")]
    assert part(est(model="small", compression="q4"), "error-feedback").where == "RAM"
    sgd = est(model="small", algorithm="sparseloco")  # momentum 0: φ alone
    assert part(sgd, "outer state").nbytes == part(sgd, "model parameters").nbytes


def test_one_stage_of_a_pipeline_holds_part_of_the_model() -> None:
    whole = part(est(model="medium"), "model parameters").nbytes
    stages = [part(est(model="medium", stages=4, role="stage", stage=i), "model parameters").nbytes for i in range(4)]
    assert all(s < whole / 2 for s in stages) and stages[1] < stages[0]  # stage 0 holds the embeddings
    assert len(est(model="medium", stages=4, role="trainer").rows) == 1  # a trainer holds no model


def test_refusal_names_the_largest_micro_batch_that_fits() -> None:
    flags = {"model": "small", "batch_size": 32, "context": 256}
    need = est(**flags).total("RAM")
    free = int(need * 0.6)
    e = est(free_ram=free, **flags)
    assert not e.fits
    e.suggestions = memory._suggest(load_config(flags, None), architecture(load_config(flags, None)), "cpu", (free, None), 0)
    line = refusal(e)
    assert "\n" not in line and "RAM (needs" in line
    m = int(re.search(r"--micro-batch-size (\d+) \(the largest", line).group(1))  # type: ignore[union-attr]
    assert 1 <= m < 32
    assert est(free_ram=free, micro_batch_size=m, **flags).fits
    assert not est(free_ram=free, micro_batch_size=m + 1, **flags).fits
    assert "--activation-checkpointing" in line


def test_nothing_fits_says_so() -> None:
    flags = {"model": "small"}
    e = est(free_ram=100 << 20, **flags)
    e.suggestions = memory._suggest(load_config(flags, None), architecture(load_config(flags, None)), "cpu", (100 << 20, None), 0)
    assert e.suggestions == [] and "no smaller setting fits" in refusal(e)


def test_fake_free_memory_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(memory.FAKE_FREE_ENV, "123")
    assert memory.free_ram() == 123 << 20
    monkeypatch.delenv(memory.FAKE_FREE_ENV)
    assert memory.free_ram() > 123 << 20


def test_the_contribution_scoring_model_is_counted_where_it_is_built() -> None:
    scoring = "contribution scoring model"
    sparse = {"model": "small", "algorithm": "sparseloco"}
    assert part(est(**sparse), scoring).nbytes == part(est(**sparse), "model parameters").nbytes
    assert part(est(device="cuda", free_vram=8 * GIB, **sparse), scoring).where == "VRAM"
    for flags in ({"contribution_scores": "off"}, {"algorithm": "noloco"}, {"algorithm": "diloco"}, {"fragments": 2},
                  {"algorithm": "diloco", "stages": 2, "role": "stage", "stage": 0}):  # pipelines refuse "on"
        assert not [r for r in est(**(sparse | flags)).rows if r.what.startswith(scoring)], flags
