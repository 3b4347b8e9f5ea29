"""The fingerprint vote of a round: which φ the members agree on, counted over established peers only.

A peer id costs nothing (a new key), so counting ids lets k fake peers outvote n < k honest ones and
make them resync from a fake state. Here a peer's vote counts only once this node has seen it take
part in ``ESTABLISHED_ROUNDS`` of its own rounds (:class:`Tenure`: what this node observed, nothing a
peer claims), and the node's own vote always counts. A node that knows no established voter yet (the
run's first rounds, or its own first rounds after joining) counts every member, as a new member must
be able to find it drifted: that window is what remains open to fake peers (docs/robustness.md); the
state it then resyncs to is still checked against the majority's content digests.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

ESTABLISHED_ROUNDS = 3  # rounds of this node's a peer must have taken part in before its vote counts
MAX_TRACKED = 4096  # peers remembered; beyond, the least recently seen are forgotten


class Tenure:
    """How many of this node's rounds each peer took part in (observed here, bounded)."""

    def __init__(self, established_rounds: int = ESTABLISHED_ROUNDS, max_tracked: int = MAX_TRACKED) -> None:
        self.established_rounds, self.max_tracked = established_rounds, max_tracked
        self.seen: dict[str, tuple[int, int]] = {}  # peer → (rounds seen in, last round seen)

    def observe(self, peers: Iterable[str], round_no: int) -> None:
        """``peers`` took part in this node's round ``round_no`` (each round counts once per peer)."""
        for peer in peers:
            count, last = self.seen.pop(peer, (0, -1))
            self.seen[peer] = (count + (last != round_no), round_no)  # re-inserted: dict order = recency
        while len(self.seen) > self.max_tracked:
            del self.seen[next(iter(self.seen))]

    def rounds(self, peer: str) -> int:
        return self.seen.get(peer, (0, -1))[0]

    def established(self, peer: str) -> bool:
        return self.rounds(peer) >= self.established_rounds


def _tie_rank(round_no: int, fingerprint: str) -> bytes:
    return hashlib.blake2b(f"{round_no}:{fingerprint}".encode(), digest_size=16).digest()


def vote(fingerprints: dict[str, str], round_no: int, me: str, tenure: Tenure | None = None) -> tuple[str, str]:
    """(fingerprint, a peer holding it) agreed in round ``round_no`` among ``{peer: fingerprint}``.

    Only ``me`` and peers ``tenure`` counts as established vote (every peer when ``tenure`` is None,
    or when none of those voting is established).
    A tie goes first to the fingerprint more of the other voters hold that took part in at least one of
    this node's rounds without being established yet: a member that joined beside a peer that later
    drifted (one that fetched nothing and averaged alone) held one established vote against its own, and
    half the time resynced to the drifted state though the third member held its own φ. Peers never seen
    in a round (free ids) break no tie. Then it goes to the fingerprint whose hash with the round number
    is smallest. Why not the smallest peer id, as before: ids are free to grind, so an attacker could
    always win ties. The hash is the same at every member (so tied honest members converge on one φ, as
    they did), and to win it an attacker must already hold as many established votes as the honest side,
    then grind a state whose fingerprint ranks first, again every round (and, in a run's first rounds,
    where nobody is established yet, a resync judges a state no majority vouches for before it adopts
    it: ``node.replica.scoring.StateJudge``). The holder named is the established one seen in most
    rounds (the state it serves is checked against the majority's digests anyway).
    """
    voters = {p: fp for p, fp in fingerprints.items() if p == me or tenure is None or tenure.established(p)}
    if len(voters) == 1 and me in voters:  # no established peer voted: everyone counts (see the module doc)
        voters = dict(fingerprints)
    counts: dict[str, int] = {}
    for fp in voters.values():
        counts[fp] = counts.get(fp, 0) + 1
    seen: dict[str, int] = {}  # the tie-break: voters seen in a round here, but not (yet) established
    for p, fp in fingerprints.items():
        if p not in voters and tenure is not None and tenure.rounds(p) >= 1:
            seen[fp] = seen.get(fp, 0) + 1
    best = max(counts.values())
    tied = [fp for fp, n in counts.items() if n == best]
    most_seen = max(seen.get(fp, 0) for fp in tied)
    agreed = min((fp for fp in tied if seen.get(fp, 0) == most_seen), key=lambda fp: _tie_rank(round_no, fp))
    holders = [p for p, fp in voters.items() if fp == agreed]
    holder = max(holders, key=lambda p: (p == me, tenure.rounds(p) if tenure else 0, p))
    return agreed, holder
