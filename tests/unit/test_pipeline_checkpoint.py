"""Whose a pipeline checkpoint is (``node.pipeline.checkpoint``), and the checkpoint folder's leftovers.

The live restart, SIGKILL and refusal tests are ``tests/integration/test_pipeline_checkpoint.py``."""

from pathlib import Path

import pytest

from node.checkpoints.checkpoint import remove_partial, save_atomic
from node.config import NodeConfig
from node.pipeline.checkpoint import check_cut, check_role, held, stage_cut
from node.runtime.resume import ResumeRefused
from swarm.models.presets import preset

FOLDER = Path("/ckpt")
FIX = "use --fresh (moves it aside) or another --checkpoint-dir"


def _cfg(role: str, stage: int | None = None, plus: bool = False) -> NodeConfig:
    return NodeConfig(stages=2, role=role, stage=stage, run_id="run-x", checkfree_plus=plus)


def _stage_checkpoint(index: int, asked_stage: int | None = None, plus: bool = False) -> dict:
    ask = index if asked_stage is None else asked_stage
    return {"settings": {"run_id": "run-x"}, "role": "stage", "asked": {"role": "stage", "stage": ask},
            "stage": stage_cut(preset("nano"), index, 2, plus)}


TRAINER = {"settings": {"run_id": "run-x"}, "role": "trainer", "asked": {"role": "trainer", "stage": None}, "trainer": {}}


def test_a_checkpoint_of_another_stage_is_refused_naming_both():
    with pytest.raises(ResumeRefused) as e:
        check_role(FOLDER, _stage_checkpoint(1), _cfg("stage", 0))
    assert str(e.value) == f"checkpoint in {FOLDER} holds stage 1 of run run-x; this node was asked for stage 0: {FIX}"


@pytest.mark.parametrize("state, cfg, refused", [
    (_stage_checkpoint(1), _cfg("stage", 1), None),
    (_stage_checkpoint(1), _cfg("auto"), None),  # auto resumes whatever the checkpoint holds
    (_stage_checkpoint(1, asked_stage=0), _cfg("stage", 0), None),  # the swarm moved it from stage 0 to 1
    (_stage_checkpoint(1), _cfg("trainer"), "holds stage 1 of run run-x; this node was asked for a trainer"),
    (TRAINER, _cfg("trainer"), None),
    (TRAINER, _cfg("auto"), None),
    (TRAINER, _cfg("stage", 0), "holds a trainer's data position in run run-x; this node was asked for stage 0"),
    ({**_stage_checkpoint(0), "asked": {"role": "spare", "stage": None}}, _cfg("spare"), None),  # a spare that rebuilt stage 0
    ({"settings": {"run_id": "run-x"}}, _cfg("auto"), "holds no pipeline stage or trainer of run run-x"),
])
def test_which_checkpoints_a_node_resumes(state, cfg, refused):
    if refused is None:
        check_role(FOLDER, state, cfg)
        return
    with pytest.raises(ResumeRefused, match=refused):
        check_role(FOLDER, state, cfg)


def test_a_stage_cut_otherwise_is_refused():
    check_cut(FOLDER, _stage_checkpoint(1), preset("nano"), 2, plus=False)
    check_cut(FOLDER, TRAINER, preset("nano"), 2, plus=True)  # a trainer holds no stage
    with pytest.raises(ResumeRefused, match="holds stage 0 of 2 as blocks 0-1; this node cuts it as stage 0 of 2 as "
                                            "blocks 0-1 with --checkfree-plus replicas"):
        check_cut(FOLDER, _stage_checkpoint(0), preset("nano"), 2, plus=True)
    assert held(_stage_checkpoint(1)) == {"role": "stage", "stage": 1}


def test_a_killed_writes_leftovers_are_removed_and_the_checkpoints_kept(tmp_path):
    save_atomic({"round": 1}, tmp_path / "checkpoint.pt")
    (tmp_path / "checkpoint.replaced-20260101T000000Z.pt").write_bytes(b"old")
    torn = tmp_path / "checkpoint.pt.abc123.tmp"
    torn.write_bytes(b"torn")
    assert remove_partial(tmp_path) == [torn]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.replaced-20260101T000000Z.pt"]


def test_node_eval_refuses_a_stage_checkpoint(tmp_path):
    from node.ops.evaluate import evaluate_checkpoint

    path = save_atomic({**_stage_checkpoint(1), "model_config": preset("nano").to_dict(), "round": 3}, tmp_path / "checkpoint.pt")
    with pytest.raises(ValueError, match="pipeline stage's checkpoint .* holds one stage of the model"):
        evaluate_checkpoint(path, None, "phi", 2, 2)
