"""No flag is accepted and dropped by a pipeline: with ``--stages 2``, every setting set to a value other than
its default is either refused at start (one line naming the flag and what to use instead) or read by the code a
pipeline node runs. ``FLAGS`` classifies every setting; a new one fails here until it is classified.

"Read by the code" is checked on the source: the entry names the file and the expression that uses the
setting on a pipeline's path (the pipeline node, its stage server and trainer, or the lifecycle every
kind shares). The behaviours this branch added to stage averaging have their own tests below.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from node.config import ConfigError, NodeConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
BASE = "node/runtime/base.py"
PRESENCE = "node/runtime/presence.py"  # networking start-up and heartbeat, mixed into the base
SERVER = "node/pipeline/stage_server.py"
STAGE_STATE = "node/pipeline/stage_state.py"  # the state a stage server offers (a mixin of its class)
NODE = "node/pipeline/node.py"
TRAINER = "node/pipeline/trainer.py"
WORKLOAD = "node/runtime/workload.py"
CLI = "node/cli/app.py"
CONFIG = "node/config/node_config.py"
DERIVED = "node/config/derived.py"  # the settings in force, derived from the given ones

# setting → (a value other than the default, how a pipeline honours it):
#   ("refused", text the one-line error holds) | ("applied", [(file, expression using it), ...])
FLAGS: dict[str, tuple[Any, tuple]] = {
    # swarm and networking: the lifecycle every kind of node shares
    "run_id": ("other-run", ("applied", [(SERVER, "stage_run(cfg.run_id"), (TRAINER, "cfg.run_id")])),
    "initial_peers": (["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"],
                      ("applied", [(PRESENCE, "cfg.initial_peers"), (SERVER, "cfg.initial_peers")])),
    "listen": (["/ip4/127.0.0.1/tcp/0"], ("applied", [(PRESENCE, "cfg.listen")])),
    "announce": (["/ip4/1.2.3.4/tcp/1"], ("applied", [(PRESENCE, "cfg.announce")])),
    "identity": (Path("id.key"), ("applied", [(PRESENCE, "cfg.identity")])),
    "swarm_key": (Path("swarm.key"), ("applied", [(PRESENCE, "read_swarm_key(cfg.swarm_key)")])),
    "reachability": ("public", ("applied", [(PRESENCE, "reachability=cfg.reachability")])),
    "relay": ("off", ("applied", [(PRESENCE, "relay_service=cfg.relay")])),
    "stream_timeout": (5.0, ("applied", [(PRESENCE, "stream_timeout=cfg.stream_timeout")])),
    "data_channel": ("off", ("applied", [(PRESENCE, 'cfg.data_channel == "on"')])),
    "data_port": (4100, ("applied", [(PRESENCE, "cfg.data_port")])),
    "max_upload_mbit": (2.0, ("applied", [(PRESENCE, "RateLimits.from_mbit(cfg.max_upload_mbit, cfg.max_download_mbit)")])),
    "max_download_mbit": (2.0, ("applied", [(PRESENCE, "RateLimits.from_mbit(cfg.max_upload_mbit, cfg.max_download_mbit)")])),
    "join_timeout": (5.0, ("applied", [(PRESENCE, "join_timeout=cfg.join_timeout"), (TRAINER, "self.cfg.join_timeout")])),
    # the model and its data
    "device": ("cpu", ("applied", [(BASE, "pick_device(cfg.device)")])),
    "model": ("nano", ("applied", [(WORKLOAD, "cfg.model"), (STAGE_STATE, "self.cfg.model")])),
    "model_config_file": (None, ("applied", [(WORKLOAD, "config_from_hf(cfg.model_config_file)")])),  # needs a file: see below
    "context": (64, ("applied", [(WORKLOAD, "cfg.context")])),
    "data": (None, ("applied", [(WORKLOAD, "cfg.data")])),  # needs a folder: the live pipeline test trains on shards
    "threads": (1, ("applied", [(BASE, "torch.set_num_threads(cfg.threads)")])),
    "seed": (3, ("applied", [(TRAINER, "train_batches(cfg.batch_size, cfg.seed)"), (TRAINER, "Router(seed=cfg.seed")])),
    "init_seed": (3, ("applied", [(SERVER, "cfg.init_seed if cfg.init_seed is not None"), (NODE, "seed=stage_init_seed(cfg)")])),
    "init_from": (ROOT, ("refused", "--init-from starts whole-model replicas")),
    # inner training
    "batch_size": (4, ("applied", [(TRAINER, "cfg.batch_size")])),
    "lr": (3e-3, ("applied", [(SERVER, "cfg.lr * lr_scale")])),
    "warmup_steps": (5, ("applied", [(SERVER, "schedule=cfg.schedule()"), (DERIVED, "self.warmup_steps")])),
    "lr_schedule": ("wsd", ("applied", [(SERVER, "schedule=cfg.schedule()"), (DERIVED, "LrSchedule(self.lr_schedule")])),
    "total_steps": (100, ("applied", [(SERVER, "schedule=cfg.schedule()"), (DERIVED, "self.total_steps if self.total_steps")])),
    "lr_floor": (0.5, ("applied", [(SERVER, "schedule=cfg.schedule()"), (DERIVED, "self.lr_floor")])),
    "inner_optimizer": ("muon", ("applied", [(SERVER, "inner_optimizer=cfg.inner_optimizer")])),
    "weight_decay": (0.0, ("applied", [(SERVER, "cfg.weight_decay")])),
    "slowdown": (2.0, ("applied", [(SERVER, "slowdown=cfg.slowdown")])),
    "slowdown_after": (5.0, ("refused", "--slowdown-after times a whole-model replica's inner steps")),
    "micro_batch_size": (2, ("refused", "--micro-batch-size is for whole-model replicas")),
    "activation_checkpointing": (True, ("refused", "--activation-checkpointing is for whole-model replicas")),
    "compile": (True, ("refused", "--compile is for whole-model replicas")),
    "compile_mode": ("reduce-overhead", ("refused", "--compile-mode is for whole-model replicas")),
    "inner_steps": (10, ("refused", "--inner-steps counts a whole-model replica's steps per round; pipeline stages average "
                                    "every --sync-every seconds")),
    "round_steps": (10, ("refused", "--round-steps counts a whole-model replica's steps")),
    "helper_below": (0.2, ("refused", "--helper-below picks a whole-model replica's role")),
    "step_while_gathering": (False, ("refused", "--no-step-while-gathering paces a whole-model replica's rounds")),
    # averaging (a stage's replicas run the replicas' DiLoCo rounds)
    "algorithm": ("noloco", ("refused", "pipeline stages average with --algorithm diloco")),
    "compression": ("q8", ("applied", [(SERVER, "cfg.codec")])),
    "error_feedback_decay": (0.5, ("applied", [(SERVER, "cfg.feedback_decay()")])),
    "outer_lr": (0.5, ("applied", [(SERVER, "self.cfg.outer_hyper")])),
    "outer_momentum": (0.5, ("applied", [(SERVER, "self.cfg.outer_hyper")])),
    "outer_warmup_rounds": (3, ("applied", [(SERVER, "warmup_rounds=self.cfg.outer_warmup")])),
    "outer_device": ("same", ("applied", [(SERVER, "OuterPlacement.choose(device, cfg.outer_device)")])),
    "peak_tflops": (100.0, ("applied", [(SERVER, "peak_flops(device, cfg.peak_tflops)")])),
    "max_group_size": (4, ("applied", [(SERVER, "max_group_size=cfg.max_group_size")])),
    "aggregate": ("mean", ("applied", [(SERVER, "aggregation=cfg.aggregation")])),
    "quorum": (0.75, ("applied", [(SERVER, "averager.quorum = cfg.quorum")])),
    "averaging_timeout": (5.0, ("applied", [(SERVER, "gather_timeout=cfg.averaging_timeout"), (TRAINER, "timeout=cfg.averaging_timeout")])),
    "fragment_alpha": (0.5, ("applied", [(SERVER, "keep=self.cfg.fragment_alpha")])),
    "fragments": (2, ("refused", "--fragments streams a whole-model replica's rounds")),
    "overlap": (True, ("refused", "--overlap: a pipeline's stage servers always keep serving")),
    "auto_overlap": (True, ("refused", "--auto-overlap: a pipeline's stage servers always keep serving")),
    "overlap_mode": ("delayed", ("refused", "--overlap-mode: a stage server applies each round's result when it arrives")),
    "noloco_pull": (0.5, ("refused", "--group-size and --noloco-pull shape noloco's rounds")),
    "group_size": (3, ("refused", "--group-size and --noloco-pull shape noloco's rounds")),
    "zo_eps": (0.01, ("refused", "--zo-eps and --zo-lr are the steps of --algorithm zo")),
    "zo_lr": (0.01, ("refused", "--zo-eps and --zo-lr are the steps of --algorithm zo")),
    "zo_seed_pool": (4, ("refused", "--zo-seed-pool is used by --algorithm zo")),
    "min_peers": (2, ("refused", "--min-peers holds whole-model replicas (--stages 1)")),
    "attack": ("samples", ("applied", [(SERVER, "attacker=Attacker.from_spec(cfg.attack"), (TRAINER, "Attacker.from_spec(cfg.attack")])),
    "contribution_scores": ("on", ("refused", "--contribution-scores on screens whole-model updates")),
    # the pipeline's own
    "stages": (2, ("applied", [(NODE, "cfg.stages")])),
    "role": ("trainer", ("applied", [(NODE, 'cfg.role == "trainer"')])),
    "stage": (1, ("applied", [(NODE, "return cfg.stage")])),
    "activation_compression": ("fp16", ("applied", [(SERVER, "cfg.activation_compression"), (TRAINER, "cfg.activation_compression")])),
    "microbatches": (2, ("applied", [(TRAINER, "range(cfg.microbatches)")])),
    "stage_queue": (2, ("applied", [(SERVER, "queue_limit=cfg.stage_queue")])),
    "sync_every": (5.0, ("applied", [(SERVER, "self.cfg.sync_every")])),
    "rebalance_period": (0.0, ("applied", [(NODE, "cfg.rebalance_period")])),
    "rebalance_margin": (0.5, ("applied", [(NODE, "self.cfg.rebalance_margin")])),
    "checkfree_plus": (True, ("applied", [(SERVER, "plus=self.cfg.checkfree_plus"), (TRAINER, "plus=cfg.checkfree_plus")])),
    "recovery_grace": (2.0, ("applied", [(NODE, "grace=cfg.recovery_grace")])),
    "recovery_lr_scale": (2.0, ("applied", [(NODE, "lr_scale=self.cfg.recovery_lr_scale")])),
    # operations
    "metrics_port": (9999, ("applied", [(BASE, "self.metrics.serve(cfg.metrics_port)")])),
    "checkpoint_dir": (Path("ck"), ("applied", [(NODE, "check_role(cfg.checkpoint_dir"), (NODE, "save=self._checkpoint_when_due if self.cfg.checkpoint_dir")])),
    "checkpoint_every": (60.0, ("applied", [(NODE, "if self._checkpoint_due()")])),
    "fresh": (True, ("applied", [(BASE, "cfg.fresh")])),
    "max_steps": (10, ("applied", [(BASE, "cfg.max_steps")])),
    "duration": (10.0, ("applied", [(BASE, "cfg.duration")])),
    "eval_batches": (2, ("applied", [(WORKLOAD, "cfg.eval_batches")])),
    "eval_every": (2, ("applied", [(TRAINER, "cfg.eval_every * 10")])),
    "info_file": (Path("info.json"), ("applied", [(SERVER, "write_info(self.cfg.info_file"), (BASE, "write_info(self.cfg.info_file")])),
    "active_hours": ("22-07", ("applied", [(CLI, "supervising = cfg.active_hours is not None")])),
    "log_level": ("debug", ("applied", [(CLI, "cfg.log_level")])),
}
COMPANIONS = {"stage": {"role": "stage"}, "attack": {"role": "stage"}, "micro_batch_size": {"batch_size": 4}, "lr_schedule": {"max_steps": 100}}  # what a value needs to be valid at all


def test_every_setting_is_classified_for_pipelines() -> None:
    missing = sorted(set(NodeConfig.model_fields) - set(FLAGS))
    assert not missing, f"classify these settings for --stages > 1 (applied where, or refused): {missing}"
    assert not set(FLAGS) - set(NodeConfig.model_fields), "FLAGS names settings that no longer exist"


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_a_pipeline_refuses_or_applies_every_setting(name: str) -> None:
    value, (kind, detail) = FLAGS[name]
    field = NodeConfig.model_fields[name]
    default = field.get_default(call_default_factory=True)
    if value is not None:
        assert value != default, f"{name}: the table's value must differ from the default {default!r}"
    settings = {"stages": 2, **COMPANIONS.get(name, {}), **({name: value} if value is not None else {})}
    if kind == "refused":
        with pytest.raises(ConfigError) as err:
            load_config(settings)
        message = str(err.value)
        assert detail in message and "\n" not in message, message
        return
    if value is not None and name != "swarm_key":
        assert getattr(load_config(settings), name) is not None
    for file, expression in detail:
        assert expression in (ROOT / file).read_text(), f"--{name}: {file} no longer reads it as {expression!r}"


def test_the_replica_flags_still_work_without_stages() -> None:
    """The refusals are the pipeline's (or another algorithm's): a whole-model replica keeps them."""
    cfg = load_config({"overlap": True, "overlap_mode": "eager", "fragments": 2, "inner_steps": 10})
    assert cfg.overlap and cfg.fragments == 2 and cfg.inner_steps == 10
    assert load_config({"algorithm": "noloco", "group_size": 3, "noloco_pull": 0.5}).group_size == 3
    assert load_config({"algorithm": "zo", "zo_lr": 1e-3}).zo_lr == 1e-3
    # a whole config dumped and read back (the defaults filled in) is not a setting of its own
    cfg = NodeConfig(stages=2)
    assert NodeConfig(**cfg.model_dump()).inner_steps == cfg.inner_steps


# ---- what the stage rounds now apply --------------------------------------------------------------------
def test_a_lossy_pipeline_gets_error_feedback_and_a_warm_up_counted_from_the_stage_s_first_round() -> None:
    from gossip.outer import NesterovOuter

    cfg = NodeConfig(stages=2, compression="q8")
    assert cfg.feedback_decay() == 0.95 and cfg.outer_warmup == 5 and cfg.outer_hyper == (1.0, 0.5)
    outer = NesterovOuter(*cfg.outer_hyper, warmup_rounds=cfg.outer_warmup, first_round=1_000_000)
    # stage rounds are numbered by wall-clock epoch: without the offset every round would step at the full η
    assert [outer.lr_at(1_000_000 + r) for r in (0, 1, 4, 9)] == [0.2, 0.4, 1.0, 1.0]
    assert NesterovOuter(1.0, 0.5, warmup_rounds=5).lr_at(1_000_000) == 1.0
    assert NodeConfig(stages=2, compression="q8", error_feedback_decay=0.5).feedback_decay() == 0.5


def test_stage_weights_merge_with_fragment_alpha_and_snapshot_where_phi_lives() -> None:
    from swarm.models.presets import PRESETS
    from swarm.stage_worker import StageWorker
    from swarm.stages import Stage

    worker = StageWorker(Stage(PRESETS["nano"], 0, 2, seed=1), torch.device("cpu"))
    theta = worker.snapshot()
    phi = [t + 1.0 for t in theta]
    worker.load_weights(phi, keep=0.25)
    assert all(torch.allclose(p, 0.75 * f + 0.25 * t) for p, f, t in zip(worker.snapshot(), phi, theta))
    worker.load_weights(phi)
    assert all(torch.equal(p, f) for p, f in zip(worker.snapshot("cpu"), phi))


def test_a_stage_counts_the_model_flops_of_its_own_blocks() -> None:
    """The stages of a pipeline together do the whole model's work per token."""
    from swarm.models.presets import PRESETS, model_flops_per_token
    from swarm.stages import Stage, stage_flops_per_token

    cfg = PRESETS["llama-tiny"]
    stages = [Stage(cfg, i, 2, seed=0) for i in range(2)]
    assert sum(stage_flops_per_token(s) for s in stages) == pytest.approx(model_flops_per_token(cfg), rel=1e-9)
    assert stage_flops_per_token(stages[0]) < stage_flops_per_token(stages[1])  # the last one holds the head


def test_stage_init_follows_init_seed_else_the_run() -> None:
    from node.pipeline.stage_server import stage_init_seed
    from swarm.stages import model_seed

    assert stage_init_seed(NodeConfig(stages=2, run_id="r", seed=5)) == model_seed("r")
    assert stage_init_seed(NodeConfig(stages=2, run_id="r", seed=5, init_seed=11)) == 11
