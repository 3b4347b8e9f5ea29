"""Wire parts (``gossip/partition.py``): the shapes both sides derive, split and join as exact inverses, bad counts refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.partition import DEFAULT_PART_NUMEL, Partition, join, part_shapes, split

shapes_st = st.lists(st.one_of(st.just(()), st.tuples(st.integers(0, 9)), st.tuples(st.integers(0, 7), st.integers(1, 5)),
                               st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3))), max_size=6)


def _tensors(shapes):
    return [torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + 100 * i for i, s in enumerate(shapes)]


def test_row_blocks_by_hand() -> None:
    assert part_shapes([(10, 3)], max_numel=7) == [(2, 3)] * 5  # 7 // 3 = 2 rows per part
    assert part_shapes([(5, 4)], max_numel=3) == [(1, 4)] * 5  # a row bigger than a part: one row each
    assert part_shapes([(7,)], max_numel=3) == [(3,), (3,), (1,)]
    assert part_shapes([(), (0, 4), (2, 2)], max_numel=100) == [(), (0, 4), (2, 2)]
    assert part_shapes([(3, 2, 2)], max_numel=8) == [(2, 2, 2), (1, 2, 2)]
    assert part_shapes([(2 * DEFAULT_PART_NUMEL + 1,)]) == [(DEFAULT_PART_NUMEL,), (DEFAULT_PART_NUMEL,), (1,)]


def test_flat_runs_by_hand() -> None:
    assert Partition(max_numel=4, flat=True).shapes([(3,), (2, 2), ()]) == [(4,), (4,)]
    assert Partition(max_numel=5, flat=True).shapes([(3,), (2, 2), ()]) == [(5,), (3,)]
    assert Partition(max_numel=5, flat=True).shapes([]) == []
    assert Partition().shapes([(2, 3)]) == [(2, 3)] and Partition().max_numel == DEFAULT_PART_NUMEL and not Partition().flat


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, max_numel=st.integers(1, 12), flat=st.booleans())
def test_split_follows_the_derived_shapes_and_join_inverts_it(shapes, max_numel, flat) -> None:
    partition = Partition(max_numel=max_numel, flat=flat)
    tensors = _tensors(shapes)
    parts = partition.split(tensors)
    assert [tuple(p.shape) for p in parts] == partition.shapes(shapes)
    for p in parts:  # no part exceeds the limit unless one row alone does
        row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
        assert p.numel() <= max(max_numel, row)
    back = partition.join([p.clone() for p in parts], shapes)
    assert [tuple(t.shape) for t in back] == [tuple(s) for s in shapes]
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_row_blocks_are_views() -> None:
    t = torch.zeros(6, 2)
    parts = split([t], max_numel=4)
    parts[1].fill_(1.0)
    assert t[2:4].eq(1.0).all() and t[:2].eq(0).all() and t[4:].eq(0).all()


def test_join_refuses_a_wrong_number_of_parts() -> None:
    tensors = _tensors([(4, 2), (3,)])
    parts = split(tensors, max_numel=2)
    with pytest.raises(ValueError, match=r"7 parts for shapes that need 6"):
        join(parts + [torch.zeros(1)], [(4, 2), (3,)], max_numel=2)
    flat = Partition(max_numel=4, flat=True)
    with pytest.raises(ValueError, match=r"2 parts for shapes that need 3 flat runs"):
        flat.join(flat.split(tensors)[:2], [(4, 2), (3,)])


def test_flat_join_of_no_parts_gives_empty_tensors_of_each_shape() -> None:
    out = Partition(max_numel=4, flat=True).join([], [(0,), (0, 3)])
    assert [tuple(t.shape) for t in out] == [(0,), (0, 3)]
    assert Partition(flat=True).split([]) == []


def test_a_blocking_rounds_snapshot_of_theta_is_theta_itself_and_any_other_a_copy():
    """θ as a round reads it (``OuterPlacement.snapshot_of``): a blocking round reads fp32 host weights in place
    (the training loop waits), an overlapped or eager one, or weights of another dtype, get a copy."""
    from gossip.placement import OuterPlacement

    placement = OuterPlacement(torch.device("cpu"))
    theta = [torch.randn(3, 2), torch.randn(4)]
    still = placement.snapshot_of(theta, kept_still=True)
    assert all(s.data_ptr() == t.data_ptr() for s, t in zip(still, theta))
    moving = placement.snapshot_of(theta, kept_still=False)
    assert all(m.data_ptr() != t.data_ptr() and torch.equal(m, t) for m, t in zip(moving, theta))
    half = [t.to(torch.bfloat16) for t in theta]
    copied = placement.snapshot_of(half, kept_still=True)
    assert all(c.dtype == torch.float32 and c.data_ptr() != h.data_ptr() for c, h in zip(copied, half))
