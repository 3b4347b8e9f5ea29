"""The defaults every setting is declared with, and :func:`option`, the one way to declare a setting.

A default that depends on other settings (the outer lr by algorithm and codec, H by algorithm) lives in
one table here; ``NodeConfig`` applies it and the CLI help and README's option table quote it.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

ENV_PREFIX = "LOCOMESH_"
LOSSLESS_CODECS = ("none", "fp16", "bf16")  # no error feedback, and the outer step of dense DiLoCo


# H by algorithm where it is not by replica count (below), and the median peer's H under --inner-steps auto
# (sparse rounds are cheap, so SparseLoCo syncs more often: tiny, 4 nodes × 600 steps, H = 20 came within
# 5.4 % of dense DiLoCo at H = 30, H = 30 within 8.3 %)
DEFAULT_INNER_STEPS = {"diloco": 50, "noloco": 30, "sparseloco": 30, "zo": 50}

# DiLoCo's and SparseLoCo's default H follows the number of replicas that averaged in the last round
# (``--inner-steps by-replicas``): more replicas drift further apart between rounds, so they must meet more
# often to keep up with one process trained on their tokens (nano, 600 steps, one process on the same
# tokens at N× the batch, gap within a seed; benchmarks/results/replica_gap.json and the exploration files
# replica_gap_*.json beside it). Dense DiLoCo at H 50 trailed by −1.0 % with 2 replicas, +1.6 % with 4 and
# +3.8 % with 8 (3 seeds); at H 30 by −3.1 %, −1.1 % and +1.4 %, for 1.7× the bytes per step; at 16
# replicas (one seed) H 30 trailed by +2.9 % and H 20 by +3.2 %, so 30 stays beyond 8. SparseLoCo at H 30
# trailed by +7.7 %, +8.7 % and +10.3 %; at H 15 (one seed) by −0.1 %, +2.6 %, +5.8 %, at H 10 by −0.9 %,
# −0.5 %, +3.7 %; a larger k did worse at equal H (topk:128 at H 15: +1.7 % with 4, +6.9 % with 8).
BY_REPLICAS = "by-replicas"
STEPS_BY_REPLICAS = {  # (at most this many replicas, H); None: any number
    "diloco": ((4, 50), (None, 30)),
    "sparseloco": ((4, 15), (None, 10)),
}


def steps_for_replicas(replicas: int, algorithm: str = "diloco") -> int:
    """The H of ``algorithm`` for a round of ``replicas`` members under ``--inner-steps by-replicas``."""
    return next(steps for most, steps in STEPS_BY_REPLICAS[algorithm] if most is None or replicas <= most)


def by_replicas_text(algorithm: str = "diloco") -> str:
    """``50 up to 4 replicas, 30 beyond`` from ``STEPS_BY_REPLICAS``."""
    return ", ".join(f"{steps} up to {most} replicas" if most is not None else f"{steps} beyond"
                     for most, steps in STEPS_BY_REPLICAS[algorithm])


HELPER_BELOW = 0.1  # --helper-below's default: a replica under this share of the others' median speed helps
AUTO_STEPS_MAX_FACTOR = 20  # --inner-steps auto never goes past this × --round-steps
SPARSE_CODEC = "topk:64/4096+q2"  # SparseLoCo's default codec
LOSSY_FEEDBACK_DECAY = 0.95  # error-feedback β of lossy codecs
LOSSY_WARMUP_ROUNDS = 5  # outer-lr warm-up of DiLoCo with a lossy codec (see NodeConfig.outer_warmup)
# (outer lr, outer momentum) by algorithm, and DiLoCo's with a lossy codec or a shared-seed projection.
#
# A shared-seed projection (seed:) carries a small part of the error-feedback residual each round and the
# residual accumulates the rest, as momentum would: outer momentum on top of it overshoots (nano alone,
# seed:r=8, 40 rounds of 15 steps: with μ = 0.9 the held-out loss fell to 3.82 by round 17 and rose to
# 5.15 by round 40; with SGD, lr 1, it fell to 3.76 and was still falling), so DiLoCo with a projection
# steps like SparseLoCo. Other lossy codecs (error feedback on) keep half the momentum at lr 1: on nano,
# 2 nodes × 600 steps, the held-out loss against dense went from +3.0 % to +0.7 % (rot1), +0.9 % to
# −0.2 % (q2) and +0.1 % to −0.4 % (rot2), while dense DiLoCo was indifferent (2.286 with 0.7/0.9,
# 2.289 with 1.0/0.5).
#
# SparseLoCo steps at η = 2: a coordinate travels only once its error-feedback residual is among its
# chunk's largest, and sparse-mean applies it at the value its senders carried, so at η = 1 each round
# moved φ by less than the update it stood for (tiny, 4 nodes × 600 steps, H = 30: held-out 2.270 at
# η 1.0, 2.200 at 1.5, 2.167 at 2.0 and 2.265 at 3.0, against dense DiLoCo's 2.137). NoLoCo steps with
# β = γ = 1 (α 0.5, inside its stability region α < γ < √(2 + α²)): 2.128 against 2.196 with the
# paper's 0.7, both at H = 30.
#
# Dense DiLoCo steps at η 1, μ 0.7 (was the paper's 0.7/0.9). Against one process trained on the same
# tokens at N× the batch (benchmarks/results/replica_gap.json: nano, 600 steps, H 50, 3 seeds, gap within a
# seed), 0.7/0.9 trailed by +0.6 % with 2 replicas, +3.8 % with 4 and +7.0 % with 8; 1.0/0.7 by −1.1 %,
# +1.7 % and +3.9 %, and 1.0/0.5 by −0.9 %, +1.7 % and +4.4 %. One-seed sweeps (seed 0) found nothing
# better at H 50: 1.0/0.8 and 1.2/0.8 at 2, 4 and 8 replicas, 0.5/0.9 at 4 and 8, 0.85/0.9 and 1.0/0.9 at 4
# all did worse than 1.0/0.7. tiny with 4 nodes agreed (frontier.json: 1.0/0.5 2 % better than 0.7/0.9).
OUTER_DEFAULTS = {"diloco": (1.0, 0.7), "noloco": (1.0, 0.5), "sparseloco": (2.0, 0.0), "zo": (1.0, 0.0)}
LOSSY_DILOCO_OUTER = (1.0, 0.5)
SEED_DILOCO_OUTER = (1.0, 0.0)

SWARM, TRAIN, AVG, PIPE, OPS = "Swarm", "Training", "Averaging", "Pipeline", "Operations"  # option groups


def option(default: Any, help: str, group: str, *, default_text: str | None = None, flag: str | None = None, **limits: Any) -> Any:
    """Declare one setting: its default, the help a user reads (``node join --help``, README's table), its group, and
    how its flag is spelled when it differs from the field name; ``default_text`` says a default that depends on
    other settings. ``limits`` are pydantic's (``ge``, ``le``, ``pattern``…). A callable default is a factory."""
    extra = {"group": group, **({"default_text": default_text} if default_text else {}), **({"flag": flag} if flag else {})}
    if callable(default):
        return Field(default_factory=default, description=help, json_schema_extra=extra, **limits)
    return Field(default, description=help, json_schema_extra=extra, **limits)


def by_algorithm(values: dict[str, Any]) -> str:
    """``50; 30 for noloco and sparseloco`` from a table of defaults by algorithm (DiLoCo's first)."""
    others: dict[Any, list[str]] = {}
    for algorithm, value in values.items():
        if algorithm != "diloco" and value != values["diloco"]:
            others.setdefault(value, []).append(algorithm)
    return "; ".join([str(values["diloco"])] + [f"{v} for {' and '.join(sorted(a))}" for v, a in others.items()])


def outer_default_text(i: int) -> str:
    """The default outer lr (``i`` = 0) or momentum (1) for each algorithm and codec, from ``OUTER_DEFAULTS``."""
    table = {"diloco": OUTER_DEFAULTS["diloco"][i], "noloco": OUTER_DEFAULTS["noloco"][i],
             "sparseloco": OUTER_DEFAULTS["sparseloco"][i]}
    return (f"{table['diloco']}; {LOSSY_DILOCO_OUTER[i]} for diloco with a lossy codec ({SEED_DILOCO_OUTER[i]} with seed:); "
            f"{table['noloco']} for noloco; {table['sparseloco']} for sparseloco")
