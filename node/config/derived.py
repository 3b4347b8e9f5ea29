"""The settings a node derives from the ones it was given: the codec, aggregation, outer step, warm-up,
error feedback, H range, lr schedule and contribution screen in force. Mixed into
:class:`~node.config.node_config.NodeConfig` (which declares the fields these read); the defaults
and the measurements behind them are in ``node.config.defaults``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from node.config.defaults import (
    AUTO_STEPS_MAX_FACTOR, BY_REPLICAS, LOSSLESS_CODECS, LOSSY_DILOCO_OUTER, LOSSY_FEEDBACK_DECAY,
    LOSSY_WARMUP_ROUNDS, OUTER_DEFAULTS, SEED_DILOCO_OUTER, SPARSE_CODEC, STEPS_BY_REPLICAS, steps_for_replicas,
)

if TYPE_CHECKING:
    from swarm.lr_schedule import LrSchedule


class DerivedSettings:
    """Properties over a :class:`NodeConfig`'s fields (no fields of its own: pydantic would take annotations
    here for fields)."""

    @property
    def codec(self) -> str:
        """The pseudo-gradient codec in force."""
        if self.compression is not None:
            return self.compression
        return SPARSE_CODEC if self.algorithm == "sparseloco" else "none"

    @property
    def judges_states(self) -> bool:
        """Whether a resync judges a state that no majority vouches for by its loss before adopting it
        (``node.replica.scoring.StateJudge``): in open swarms whose replicas hold one φ (DiLoCo, SparseLoCo)."""
        return self.algorithm in ("diloco", "sparseloco") and self.swarm_key is None

    @property
    def scores_contributions(self) -> bool:
        """Whether rounds screen each update by its loss (``gossip.scores``): asked for (DiLoCo or SparseLoCo;
        NoLoCo averages weights in pairs and zo sends seeds, not updates), or by default in an open swarm
        whose rounds gather whole updates: SparseLoCo's, and dense ones that cannot reduce-scatter (another
        codec, an aggregation that needs whole updates, eager overlap). Dense rounds of three or more
        under ``mean``/``centered-clip`` reduce-scatter, so no member sees a whole update to score."""
        from gossip.reduce_scatter import PART_WISE, is_dense

        if self.algorithm not in ("diloco", "sparseloco"):
            return False
        if self.contribution_scores != "auto":
            return self.contribution_scores == "on"
        whole = (self.algorithm == "sparseloco" or not is_dense(self.codec) or self.aggregation not in PART_WISE
                 or (self.overlap and self.overlap_mode == "eager"))
        return self.swarm_key is None and whole

    @property
    def aggregation(self) -> str:
        """How a round's updates are combined: explicit, else robust in an open swarm and plain in a
        private one (``--swarm-key``: every peer holds the secret, so none is a stranger).

        Open: ``centered-clip``, ``sparse-clip`` for SparseLoCo — one peer moves the model by at most
        about one honest update, whatever it sends (``benchmarks.byzantine``). Private: the mean, or for
        SparseLoCo ``sparse-mean`` (a top-k coordinate one sender carried is applied undiluted; tiny,
        4 nodes × 600 steps: held-out loss 2.461 → 2.258 against dense DiLoCo's 2.084)."""
        if self.aggregate is not None:
            return self.aggregate
        sparse = self.algorithm == "sparseloco"
        if self.swarm_key is None:
            return "sparse-clip" if sparse else "centered-clip"
        return "sparse-mean" if sparse else "mean"

    @property
    def max_round_samples(self) -> int:
        """The most samples one round can hold: what a peer's claimed sample count is capped at. With
        ``--inner-steps auto`` a fast peer takes up to ``AUTO_STEPS_MAX_FACTOR`` × the median's steps."""
        return self.batch_size * self.inner_steps_range[1]

    def steps_for(self, replicas: int) -> int | None:
        """H for a round of ``replicas`` members: the number given, the by-replicas table's, or None under
        ``--inner-steps auto`` (a wall-clock budget instead: ``node.replica.pacing``)."""
        if self.inner_steps == "auto":
            return None
        return steps_for_replicas(replicas, self.algorithm) if self.inner_steps == BY_REPLICAS else int(self.inner_steps)

    def median_steps(self, replicas: int) -> int:
        """Under ``--inner-steps auto``: the steps the swarm's median-speed peer takes in a round of
        ``replicas`` members (``--round-steps``, or the by-replicas table's H for diloco and sparseloco)."""
        if self.round_steps is not None:
            return self.round_steps
        return steps_for_replicas(replicas, self.algorithm)

    @property
    def median_steps_range(self) -> tuple[int, int]:
        """The fewest and the most steps :meth:`median_steps` gives, whatever the replicas."""
        if self.round_steps is not None:
            return self.round_steps, self.round_steps
        return _table_range(self.algorithm)

    @property
    def inner_steps_range(self) -> tuple[int, int]:
        """The fewest and the most inner steps a round of this node can hold: H, the by-replicas table's
        range, or under ``--inner-steps auto`` one step to ``AUTO_STEPS_MAX_FACTOR`` × the median's."""
        if self.inner_steps == "auto":
            return 1, self.median_steps_range[1] * AUTO_STEPS_MAX_FACTOR
        if self.inner_steps == BY_REPLICAS:
            return _table_range(self.algorithm)
        return int(self.inner_steps), int(self.inner_steps)

    @property
    def outer_hyper(self) -> tuple[float, float]:
        """(outer lr, outer momentum) in force for the algorithm and codec (the tables and the measurements
        behind them: ``node.config.defaults``)."""
        lr_default, momentum_default = OUTER_DEFAULTS[self.algorithm]
        if self.algorithm == "diloco" and self.codec.startswith("seed:"):
            lr_default, momentum_default = SEED_DILOCO_OUTER
        elif self.algorithm == "diloco" and self.codec not in LOSSLESS_CODECS:
            lr_default, momentum_default = LOSSY_DILOCO_OUTER
        return (
            self.outer_lr if self.outer_lr is not None else lr_default,
            self.outer_momentum if self.outer_momentum is not None else momentum_default,
        )

    @property
    def outer_warmup(self) -> int:
        """Rounds over which the outer lr warms up (``NesterovOuter.lr_at``), counted from the run's start.

        DiLoCo with a lossy codec steps at η = 1 with momentum 0.5 from its first round, where the
        pseudo-gradients are the largest: φ overshot for a round now and then (nano, 2 nodes from round
        0, 15 steps a round: a held-out spike at round 3 in 3 of 10 runs with rot2 and 1 of 6 with q2,
        3.2 → 3.7–4.1, once 6.8 in CI, while dense DiLoCo did not in 4). Warming η up over 5 rounds removed
        the spikes in the in-process simulation of those runs (4 of 4 smooth, and 2.82 instead of
        3.00–3.12 by round 5)."""
        if self.outer_warmup_rounds is not None:
            return self.outer_warmup_rounds
        lossy = self.codec not in LOSSLESS_CODECS and not self.codec.startswith("seed:")
        return LOSSY_WARMUP_ROUNDS if self.algorithm == "diloco" and lossy else 0

    def schedule(self) -> "LrSchedule":
        """The inner lr schedule in force (``swarm.lr_schedule``); its length is --total-steps, else --max-steps."""
        from swarm.lr_schedule import LrSchedule

        return LrSchedule(self.lr_schedule, self.warmup_steps, self.total_steps if self.total_steps is not None else self.max_steps,
                          self.lr_floor)

    @property
    def model_seed(self) -> int:
        """The seed of the model's initialisation in force."""
        return self.seed if self.init_seed is None else self.init_seed

    def feedback_decay(self) -> float:
        """The error-feedback β in force: explicit, else 0.95 for lossy codecs and 0 for (near-)lossless ones."""
        if self.error_feedback_decay is not None:
            return self.error_feedback_decay
        return 0.0 if self.codec in LOSSLESS_CODECS else LOSSY_FEEDBACK_DECAY


def _table_range(algorithm: str) -> tuple[int, int]:
    """The fewest and the most steps the by-replicas table gives ``algorithm``."""
    steps = [h for _, h in STEPS_BY_REPLICAS[algorithm]]
    return min(steps), max(steps)
