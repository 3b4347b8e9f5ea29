"""Bounded averaging groups (Moshpit-style): a swarm larger than ``--max-group-size`` G averages each
round in random groups of about G that change every round, so a member's cost per round depends on G,
not on the swarm's size, and information still mixes across the swarm round after round.

Groups are computed, not negotiated: with N live members the round has ``group_count(N, G)`` groups
(1 up to N = G, then the power of two that brings groups to G or fewer on average), and a member's
group is a hash of (run, round, its peer id) modulo that count. Everyone derives the same groups from
the same member list; a member that sees a slightly different N still derives the same count unless
N crosses a power-of-two boundary (G, 2G, 4G, ...), and then only its own rendezvous is affected
(it registers under another group's key and averages with those who agree). A rendezvous does not
wait for such members: it looks for them under the other groupings (:func:`other_groupings`) and
stops waiting for those it finds there, instead of waiting out its deadline. Group sizes are
binomial around N / count: "about G", not exactly.

Reference: Ryabinin et al. 2021, Moshpit SGD, https://arxiv.org/abs/2103.03239 (groups that change
every round; averaging within them converges to the global mean).
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable


def group_count(members: int, max_group_size: int) -> int:
    """Groups in a round of ``members`` live members: 1 while they fit in one group of ``max_group_size``,
    else the smallest power of two whose groups hold at most ``max_group_size`` members on average."""
    if max_group_size < 2:
        raise ValueError(f"a group needs room for at least 2 members, got max group size {max_group_size}")
    if members <= max_group_size:
        return 1
    return 1 << math.ceil(math.log2(members / max_group_size))


def group_of(run_id: str, round_no: int, peer_id: str, count: int) -> int:
    """The group (0..count-1) of ``peer_id`` in round ``round_no``: uniform, and independent across rounds."""
    digest = hashlib.blake2b(f"{run_id}/{round_no}/{peer_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % count


def split_into_groups(run_id: str, round_no: int, members: Iterable[str], count: int) -> list[list[str]]:
    """Every member in exactly one of ``count`` groups (each sorted by peer id; a group may be empty)."""
    groups: list[list[str]] = [[] for _ in range(count)]
    for peer in sorted(set(members)):
        groups[group_of(run_id, round_no, peer, count)].append(peer)
    return groups


def group_tag(group: int, count: int) -> str:
    """Names a round's group in its rendezvous key and wire settings, e.g. ``g3of8``."""
    return f"g{group}of{count}"


def other_groupings(run_id: str, round_no: int, peers: Iterable[str], mine: int, max_group_size: int) -> dict[str, set[str]]:
    """Where ``peers`` would have registered for ``round_no`` had they counted one power-of-two boundary
    otherwise than this member (``mine`` groups): {rendezvous tag ("" for one group): peers}, for half
    and twice ``mine`` groups."""
    tags: dict[str, set[str]] = {}
    for count in {max(1, mine // 2), mine * 2} - {mine}:
        for p in peers:
            tags.setdefault("" if count == 1 else group_tag(group_of(run_id, round_no, p, count), count), set()).add(p)
    return tags


def near_a_grouping_boundary(counted: int, mine: int, max_group_size: int) -> bool:
    """Whether members that counted half or twice ``counted`` would group otherwise than ``mine`` groups:
    only then can an awaited peer have registered under another grouping (a swarm far below the bound
    never looks)."""
    return any(group_count(n, max_group_size) != mine for n in (max(1, counted // 2), 2 * counted))
