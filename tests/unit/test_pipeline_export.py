"""Assembling a pipeline's stages into the whole model for ``node export --initial-peers`` (the network half is
tests/integration/test_pipeline_llama.py): every stage's weights land under the whole model's names, CheckFree+
replicas are left out, and the head is untied."""

from __future__ import annotations

import pytest
import torch

from node.errors import UserError
from node.ops.pipeline_export import StageWeights, assemble
from swarm.models.llama import hf_name
from swarm.models.presets import PRESETS, build_model
from swarm.stages import Stage


def _stage_weights(count: int, plus: bool, cfg=PRESETS["llama-tiny"]) -> list[StageWeights]:
    meta = {"model_config": cfg.to_dict(), "stages": count, "checkfree_plus": plus, "tokenizer": "bytes"}
    stages = [Stage(cfg, i, count, seed=5, plus=plus) for i in range(count)]
    return [StageWeights(i, 7, f"peer{i}", meta, [p.detach().clone() for p in s.parameters()]) for i, s in enumerate(stages)]


@pytest.mark.parametrize("count,plus", [(2, False), (3, False), (4, True)])
def test_the_stages_assemble_into_the_whole_model(count: int, plus: bool) -> None:
    cfg, tensors = assemble(_stage_weights(count, plus))
    assert not cfg.tie_embeddings
    torch.manual_seed(5)
    whole = build_model(PRESETS["llama-tiny"])  # the initialisation every stage is cut from
    expected = {hf_name(n): p for n, p in whole.named_parameters()}
    expected["lm_head.weight"] = whole.tok_emb.weight  # tied in the preset, untied (a copy) in the stages
    assert set(tensors) == set(expected)
    assert all(torch.equal(tensors[n], expected[n]) for n in expected)


def test_stages_of_different_runs_and_gpts_are_refused() -> None:
    stages = _stage_weights(2, False)
    stages[1].meta = {**stages[1].meta, "stages": 3}
    with pytest.raises(UserError, match="another model or stage count"):
        assemble(stages)
    with pytest.raises(UserError, match="byte-level GPT"):
        assemble(_stage_weights(2, False, PRESETS["nano"]))
