"""Reduce-scatter + all-gather for dense rounds: who reduces which wire parts, and when it pays.

In an all-gather every member fetches every other member's whole update, so a member receives
(G − 1) × the payload per round. In a reduce-scatter each member owns a share of the wire parts: it
fetches only those parts from every other member, reduces them (the same weighted mean as
``gossip.aggregate``), encodes the result once and serves it; every member then fetches each owner's
reduced parts. A member sends and receives about 2 × (G − 1)/G × the payload whatever the group
size (hivemind's butterfly all-reduce, ``hivemind/averaging/allreduce.py``, has the same shape).

The owners of a group are assigned here, from the sorted member ids and the parts' sizes only, so
every member computes the same assignment without talking. Parts are dealt as contiguous runs whose
element counts are as even as the parts allow.

An owner's answer is a claim: a member applies reduced parts only when their norm is plausible against
its own update on the same parts (:func:`implausible_share`); otherwise it reduces those parts itself
from the members' contributions, as it does when an owner is gone.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from compression import get_codec
from compression.topk import TopKCompression
from gossip.aggregate import claim_cap
from gossip.exchange import ReducedShare
from gossip.outer import l2_norm
from gossip.partition import DEFAULT_PART_NUMEL, Partition

# codecs whose reduced result keeps its form (a mean of dense updates is dense); sparse and
# shared-seed payloads keep the all-gather, which is cheaper for them
DENSE_CODECS = frozenset({"none", "fp16", "bf16", "q8", "q4", "q2", "rot1", "rot2", "rot4", "rot8", "int8-block"})
FINE_PARTS = 256  # a dense round's wire parts per model: enough for even shares in groups of up to 64
ELEMENTWISE_CODECS = frozenset({"none", "fp16", "bf16"})  # no per-part tables: a run across tensors codes as well
# every part costs each member a frame, a decode, a check and a share of the aggregation and the outer step: a
# model of up to FLAT_MAX values under an elementwise codec travels in equal flat runs across its tensors instead
# of row blocks of each (tiny's 238 parts, a third of them 128-value norms, made its four-member exchange ~1.5 × as
# long; now 49); joining the runs back costs a copy of the update, small at that size
FLAT_MAX = 1 << 24


def is_dense(codec: str) -> bool:
    """Whether a round with this codec can be reduce-scattered (its updates are dense)."""
    return codec.split(":", 1)[0] in DENSE_CODECS


def fine_part_numel(total_numel: int, max_numel: int = 1 << 20, floor: int = 16384) -> int:
    """Largest elements per wire part that still cuts a dense update into about ``FINE_PARTS`` parts,
    but never below ``floor``: a part's header and tables (q8's 256-entry table) would cost too much
    (bits per value at 4096 / 16384 / 65536 values: q8 10.4 / 8.66 / 8.21, q2 2.47 / 2.16 / 2.09)."""
    return max(floor, min(max_numel, -(-total_numel // FINE_PARTS)))


def wire_partition(codec: str, shapes: Sequence[Sequence[int]], noloco: bool = False) -> Partition:
    """How a run's pseudo-gradients are cut into wire parts: fine parts for dense codecs (their rounds
    may reduce-scatter; a small model under an elementwise codec: equal flat runs), flat runs for top-k
    whose values are scaled per chunk (float32 or ``+q2``: its
    chunks need no tensor structure, and one payload header serves many small tensors), the default
    row blocks otherwise (NoLoCo's pairs always
    all-gather; DCT and shared-seed codecs work per tensor)."""
    total = sum(math.prod(shape) for shape in shapes)
    if codec in ELEMENTWISE_CODECS and not noloco and total <= FLAT_MAX:
        return Partition(fine_part_numel(total), flat=True)
    if is_dense(codec) and not noloco:
        return Partition(fine_part_numel(total))  # row blocks: φ and the momentum step through views of them
    chosen = get_codec(codec)
    return Partition(DEFAULT_PART_NUMEL, flat=type(chosen) is TopKCompression and chosen.chunk_local)


def assign_owners(part_numels: Sequence[int], members: Sequence[str]) -> dict[str, list[int]]:
    """{member: the parts it reduces}: contiguous runs of parts, members in sorted order, each run
    ending where its cumulative element count first reaches the member's even share.

    Every part has exactly one owner; a member may own none when there are fewer parts than members.
    """
    ordered = sorted(members)
    owners: dict[str, list[int]] = {m: [] for m in ordered}
    if not ordered:
        return owners
    total = sum(part_numels)
    g = len(ordered)
    done = 0
    k = 0
    for i, numel in enumerate(part_numels):
        # the part goes to the member whose share contains the part's midpoint
        middle = done + numel / 2
        while k < g - 1 and middle >= total * (k + 1) / g:
            k += 1
        owners[ordered[k]].append(i)
        done += numel
    return owners


# Aggregations an owner can run on its parts alone: the weighted mean, and centered clipping part by
# part (as BTARD-SGD clips inside each partition of a butterfly all-reduce: every part's influence is
# bounded by its own clipping radius). Per-update norms, trimming and sparse masks need whole updates.
PART_WISE = ("mean", "centered-clip")


def use_reduce_scatter(dense: bool, group_size: int, aggregation: str, needs_every_update: bool) -> bool:
    """Reduce-scatter pays from three members on (with two both ways cost one payload each way) for
    dense codecs (``is_dense``) and part-wise aggregations (``PART_WISE``); other robust aggregations
    and eager overlap need every member's whole update, so they keep the all-gather."""
    return group_size >= 3 and dense and aggregation in PART_WISE and not needs_every_update


def round_bytes(payload: int, group_size: int, reduce_scatter: bool) -> int:
    """Bytes a member sends in one round (each direction alike) under either scheme."""
    if group_size <= 1:
        return 0
    if reduce_scatter:
        return int(2 * payload * (group_size - 1) / group_size)
    return payload * (group_size - 1)


# An owner's reduced parts may be at most this many times the norm of this member's own update on the same
# parts: the mean of the members' parts is no longer than the longest, and centered clipping moves a part
# by about one honest update at most. A share beyond it is not applied; its parts are reduced here from the
# members' contributions (the fallback for a failed owner), so an honest share wrongly refused costs bytes,
# not correctness.
OWNER_NORM_BOUND = 4.0


UNSEEN_CLAIM_FACTOR = 4.0


def bounded_unseen(claims: Mapping[str, int], factor: float = UNSEEN_CLAIM_FACTOR) -> dict[str, int]:
    """Claims of updates this member never saw (it reduced no parts, so no norm bounds them), as they may
    widen :func:`steps_scale`: each at most ``factor`` × the lower-median claim. An honest member up to
    ``factor`` × the median's speed keeps its claim; a liar's 10⁹ widens the bound as a member ``factor`` ×
    faster would (a share it refuses wrongly costs bytes: its parts are fetched from the members)."""
    cap = claim_cap(list(claims.values()), claim_factor=factor)
    return {p: s if cap is None else min(s, cap) for p, s in claims.items()}


def steps_scale(samples: Sequence[int], mine: int) -> float:
    """How much longer than this member's own update the round's aggregate may honestly be when members
    took different numbers of steps (``--inner-steps auto``): the sample-weighted mean of the members'
    sample counts over this member's own, at least 1 (an update grows about linearly with the steps behind
    it: a member 6× slower saw aggregates 4–5× its own norm). The counts are claims capped at what a round
    can hold and, where this member reduced parts, as they weighed there (at most twice the samples each
    update's norm stands for: ``gossip.aggregate.supported_claims``), so a liar's claim of 10⁹ samples
    widens the bound about as much as an honest peer twice its speed would."""
    total = sum(samples)
    if mine <= 0 or total <= 0:
        return 1.0
    return max(1.0, sum(n * n for n in samples) / total / mine)


def implausible_share(share: ReducedShare, parts: Sequence[int], own: Sequence[torch.Tensor], scale: float = 1.0) -> str | None:
    """Why an owner's reduced ``parts`` cannot be an aggregate of the round's updates (their norm is over
    ``OWNER_NORM_BOUND`` × ``scale`` (:func:`steps_scale`) times this member's own update on those parts),
    or None when they can be."""
    theirs = l2_norm([share.decoded[i] for i in parts])
    mine = l2_norm([own[i] for i in parts])
    bound = OWNER_NORM_BOUND * scale
    if theirs > bound * mine:
        return f"norm {theirs:.4g} against this member's own {mine:.4g} on the same parts (bound: {bound:.3g}x)"
    return None
