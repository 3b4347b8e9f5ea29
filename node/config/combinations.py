"""Settings that are valid alone but not together: each refused in one line saying what to use instead.

``NodeConfig`` calls :func:`check_combinations` after every field has passed its own validator.
"""

from __future__ import annotations

from typing import Any

from node.config.defaults import BY_REPLICAS, HELPER_BELOW, STEPS_BY_REPLICAS


def _default(cfg: Any, name: str) -> Any:
    return type(cfg).model_fields[name].default


def check_combinations(cfg: Any) -> None:
    """Raise ValueError naming the first combination of a ``NodeConfig``'s settings that cannot work together
    (typed ``Any``: this module sits below ``node_config``, which imports it)."""
    memory_flags = [flag for flag, on in (("--micro-batch-size", cfg.micro_batch_size is not None),
                                          ("--activation-checkpointing", cfg.activation_checkpointing),
                                          ("--compile", cfg.compile),
                                          ("--compile-mode", cfg.compile_mode != "default")) if on]
    if memory_flags and cfg.stages > 1:
        raise ValueError(f"{', '.join(memory_flags)} {'is' if len(memory_flags) == 1 else 'are'} for whole-model replicas (--stages 1), "
                         "not pipelines (a pipeline trainer cuts its batches with --microbatches)")
    if cfg.algorithm == "zo" and (cfg.micro_batch_size is not None or cfg.activation_checkpointing):
        raise ValueError("--micro-batch-size and --activation-checkpointing do not apply to --algorithm zo (forward passes only, no gradients)")
    if cfg.micro_batch_size is not None and cfg.micro_batch_size > cfg.batch_size:
        raise ValueError(f"--micro-batch-size {cfg.micro_batch_size} is larger than --batch-size {cfg.batch_size}: it cuts each batch "
                         f"into pieces, so use at most {cfg.batch_size} (or raise --batch-size)")
    if cfg.algorithm == "zo" and (cfg.lr_schedule != "constant" or cfg.inner_optimizer != "adamw"):
        raise ValueError("--lr-schedule and --inner-optimizer do not apply to --algorithm zo: every replica replays the swarm's "
                         "steps at the agreed --zo-lr; use the defaults (constant, adamw)")
    if cfg.lr_schedule != "constant":
        cfg.schedule()  # raises naming what is missing (the run's length) or out of range
    if cfg.algorithm == "zo":
        for wrong, why in ((cfg.fragments > 1, "--fragments"), (cfg.overlap, "--overlap"), (cfg.auto_overlap, "--auto-overlap"),
                           (cfg.compression not in (None, "none"), "--compression")):
            if wrong:
                raise ValueError(f"{why} does not apply to --algorithm zo (it sends one byte per step and never a model)")
    elif cfg.zo_seed_pool:
        raise ValueError("--zo-seed-pool is used by --algorithm zo; other algorithms send pseudo-gradients, not seeds")
    if cfg.auto_overlap and (cfg.overlap or cfg.overlap_mode != "asap"):
        raise ValueError("--auto-overlap chooses --overlap (asap) itself from what rounds cost: drop --overlap and --overlap-mode, "
                         "or keep them and drop --auto-overlap to overlap from the start")
    if cfg.overlap_mode == "eager" and cfg.algorithm == "noloco":
        raise ValueError("--overlap-mode eager estimates a group average: use it with diloco or sparseloco")
    if cfg.fragments > 1 and cfg.algorithm == "noloco":
        raise ValueError("--fragments works with diloco and sparseloco; noloco sends whole models (use --fragments 1)")
    if cfg.attack is not None:
        _attack_refusals(cfg)
    if cfg.contribution_scores == "on" and (cfg.stages > 1 or cfg.algorithm not in ("diloco", "sparseloco")):
        raise ValueError("--contribution-scores on screens whole-model updates of diloco and sparseloco replicas (--stages 1); "
                         "use auto or off")
    if cfg.stages > 1:
        _pipeline_refusals(cfg)
    if cfg.algorithm != "zo" and (cfg.zo_eps, cfg.zo_lr) != (_default(cfg, "zo_eps"), _default(cfg, "zo_lr")):
        raise ValueError("--zo-eps and --zo-lr are the steps of --algorithm zo; other algorithms take --lr and --outer-lr")
    if cfg.algorithm != "noloco" and (cfg.group_size != _default(cfg, "group_size") or cfg.noloco_pull is not None):
        raise ValueError("--group-size and --noloco-pull shape noloco's rounds; diloco and sparseloco groups are bounded by "
                         "--max-group-size")
    if cfg.stages > 1 and cfg.init_from is not None:
        raise ValueError("--init-from starts whole-model replicas (--stages 1); a pipeline's stages start from the run's seed")
    if cfg.model_config_file is not None and cfg.init_from is not None:
        raise ValueError("--init-from a folder brings its own architecture: leave out --model-config")
    layers = cfg._layers()
    if cfg.stages > layers:
        raise ValueError(f"--stages {cfg.stages}: model {cfg.model!r} has only {layers} blocks to split")
    if cfg.stage is not None and cfg.stage >= cfg.stages:
        raise ValueError(f"--stage {cfg.stage} does not exist in a {cfg.stages}-stage pipeline (stages are 0..{cfg.stages - 1})")
    if cfg.stages > 1 and cfg.min_peers > 1:
        raise ValueError("--min-peers holds whole-model replicas (--stages 1); a pipeline waits for its stages on its own")
    if cfg.stages > 1 and cfg.algorithm != "diloco":
        raise ValueError("pipeline stages average with --algorithm diloco (any --compression)")
    if cfg.fragments > layers:
        raise ValueError(f"--fragments {cfg.fragments}: model {cfg.model!r} has only {layers} blocks to split")
    if cfg.inner_steps == BY_REPLICAS and cfg.algorithm not in STEPS_BY_REPLICAS:
        raise ValueError(f"--inner-steps by-replicas sizes diloco's and sparseloco's rounds (what it was measured for); give "
                         f"--algorithm {cfg.algorithm} a number of steps or auto")
    steps = cfg.median_steps_range[0] if cfg.inner_steps == "auto" else cfg.inner_steps_range[0]
    if cfg.fragments > steps:
        raise ValueError(f"--fragments {cfg.fragments} needs at least as many inner steps per round, got {steps}")



def _attack_refusals(cfg: Any) -> None:
    """Where ``--attack`` (experiments) applies: a replica's or a stage replica's round (not zo), or, for
    ``activations``, a pipeline trainer."""
    from gossip.byzantine import TRAINER_ATTACKS, parse_attacks

    names = {name for name, _ in parse_attacks(cfg.attack)}
    trainer = names & set(TRAINER_ATTACKS)
    if cfg.algorithm == "zo":
        raise ValueError("--attack rewrites a pseudo-gradient round or a pipeline trainer's requests: not --algorithm zo")
    if trainer and (cfg.stages == 1 or cfg.role != "trainer" or names - trainer):
        raise ValueError(f"--attack {', '.join(sorted(trainer))} is a pipeline trainer's: use it alone with --stages > 1 --role trainer")
    if not trainer and cfg.stages > 1 and cfg.role != "stage":
        raise ValueError("--attack in a pipeline rewrites a stage replica's round: use it with --role stage "
                         "(a trainer takes activations:K)")


def _pipeline_refusals(cfg: Any) -> None:
    """Replica flags that mean nothing to a pipeline (--stages > 1), each refused with what to use instead."""
    for wrong, why in (
        (cfg.overlap, "--overlap: a pipeline's stage servers always keep serving while their stage averages"),
        (cfg.auto_overlap, "--auto-overlap: a pipeline's stage servers always keep serving while their stage averages"),
        (cfg.overlap_mode != "asap", "--overlap-mode: a stage server applies each round's result when it arrives (asap)"),
        (cfg.slowdown_after > 0, "--slowdown-after times a whole-model replica's inner steps (a stage server takes --slowdown "
                                  "from the start)"),
        (not cfg.step_while_gathering, "--no-step-while-gathering paces a whole-model replica's rounds (a stage server keeps "
                                       "serving while its stage averages)"),
        (cfg.helper_below != HELPER_BELOW, "--helper-below picks a whole-model replica's role; a pipeline routes fewer "
                                           "microbatches to a slow stage server instead"),
        (cfg.fragments > 1, "--fragments streams a whole-model replica's rounds; a pipeline averages each stage on its "
                             "own, every --sync-every seconds"),
    ):
        if wrong:
            raise ValueError(f"{why}; leave it out with --stages > 1")
