"""Whom a node downloads a state from, and which digests what arrives must match.

A state is a peer's claim until checked. Every download of a whole state (a replica's join, resync and
catch-up; a pipeline stage's join, resync and CheckFree neighbour) is planned here the same way:

1. Candidates are ranked by what the node can check, never first by the round a peer announces for
   itself: the round most candidates announce is the swarm's, and a candidate announcing a round more
   than one ahead of it is not asked at all (one record of round 10⁹ would otherwise be asked first
   and alone).
2. Up to :data:`VERIFY_PEERS` of them are asked for their state's header only (one frame each,
   ``gossip.state_transfer.state_headers``). When a strict majority of those that answered holds one
   (round, digests), only its holders are downloaded from, and what arrives must match those digests
   (``trusted``): a peer that serves other bytes is skipped, never adopted.
3. Without a majority (one answer, or a tie) the plan falls back to each candidate checked against its
   own header's digests, unless the caller would rather ask again (a resync waiting for the round's
   members to publish).

Ids are free: where the caller knows established peers (seen in several of its own rounds, as the
fingerprint vote counts them), only their answers make the majority.

A peer that answers with another state of the majority's round is *dissent*: the caller logs and
counts it (``poisoned``). A peer at another round is only behind or ahead, and is left out quietly.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from gossip.state_transfer import Expected, majority_state, state_headers
from protocol.hivemind_transport import Transport

logger = logging.getLogger(__name__)
VERIFY_PEERS = 5  # peers asked for their state's digests before a download
STRIPE_PEERS = 4  # a download takes an even share from up to this many peers that hold the same state


@dataclass(frozen=True)
class SourcePlan:
    """The downloads to try, in order, and the digests what arrives must match (None: its own header's)."""

    attempts: list[list[str]]
    trusted: dict[str, str] | None = None
    round: int | None = None  # the majority's round, when there is one
    dissent: list[str] = field(default_factory=list)  # answered with another state of the majority's round
    ignored: list[str] = field(default_factory=list)  # announced a round far ahead of the swarm's: not asked

    def left_out(self, what: str, seen: set[str] | None = None) -> list[str]:
        """Log the peers this plan leaves out (``what``: the state, for the messages) and return those that
        answered with another state and are not in ``seen`` (which grows by them), for the caller to
        count as ``poisoned``: a caller that plans again logs and counts each such peer once."""
        if self.ignored:
            logger.warning("not downloading %s from %d peer(s) announcing rounds far ahead of the others': %s",
                           what, len(self.ignored), ", ".join(p[-8:] for p in self.ignored))
        fresh = [p for p in self.dissent if seen is None or p not in seen]
        if fresh:
            logger.warning("peers %s hold a state of %s other than the majority's; not downloading from them",
                           ", ".join(p[-8:] for p in fresh), what)
            if seen is not None:
                seen.update(fresh)
        return fresh


_DRAW_KEY = secrets.token_bytes(16)  # no peer can predict where its id falls in this node's draws


def _draw(peer: str) -> bytes:
    return hashlib.blake2b(peer.encode(), key=_DRAW_KEY, digest_size=8).digest()


def rank_candidates(rounds: dict[str, int], prefer: str | None = None,
                    established: Callable[[str], bool] = lambda peer: False) -> tuple[list[str], list[str]]:
    """The candidates to ask, best first, and those announcing a round more than one ahead of the round
    most of them announce (ties: the later round). ``prefer`` (a peer the caller has reason to trust, e.g.
    the vote's) leads when it is near, then established peers, then the nearest that round, the later
    round, then a draw keyed by a secret of this process (a tie broken by peer id let the lowest ids,
    which are free to grind, form a fresh joiner's "majority")."""
    if not rounds:
        return [], []
    counts = Counter(rounds.values())
    swarm_round = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    near = sorted((p for p, r in rounds.items() if r <= swarm_round + 1),
                  key=lambda p: (p != prefer, not established(p), abs(rounds[p] - swarm_round), -rounds[p], _draw(p)))
    return near, sorted(p for p, r in rounds.items() if r > swarm_round + 1)


def attempts_of(peers: Sequence[str], stripe: int = STRIPE_PEERS) -> list[list[str]]:
    """Download attempts over ``peers`` (which should hold the same state): striped across up to
    ``stripe`` of them when there are several, then each alone."""
    striped = [list(peers[:stripe])] if stripe > 1 and len(peers) > 1 else []
    return striped + [[p] for p in peers]


async def plan_sources(transport: Transport, rounds: dict[str, int], run_id: str, expected: Expected, *,
                       prefer: str | None = None, min_round: int | None = None, fallback: bool = True,
                       established: Callable[[str], bool] = lambda peer: False,
                       stripe: int = STRIPE_PEERS, verify: int = VERIFY_PEERS, timeout: float = 10.0) -> SourcePlan:
    """Plan a download among the peers of ``rounds`` ({peer: the round it announces}); see the module's
    docstring. ``min_round``: a majority below this round does not count (its holders have not yet
    published the state wanted). ``fallback``: without such a majority, plan each candidate checked
    against its own header (else, unless there is only one candidate, no attempt: the caller asks again later).
    ``established``: the peers this node saw in enough of its rounds (``gossip.votes.Tenure``); when any of
    those asked is, only theirs count toward the majority, as in the fingerprint vote (ids are free), and
    the others that hold the same state are holders too."""
    near, ignored = rank_candidates(rounds, prefer, established)
    asked = near[:verify]
    headers = await state_headers(transport, asked, run_id, expected, timeout) if len(asked) > 1 else {}
    voters = {p: h for p, h in headers.items() if established(p)} or headers
    majority = majority_state(voters)
    if majority is not None and (min_round is None or majority[0] >= min_round):
        round_no, trusted, _ = majority
        ordered = [p for p in asked if headers.get(p) == (round_no, trusted)]
        dissent = sorted(p for p, (r, digests) in headers.items() if r == round_no and digests != trusted)
        return SourcePlan(attempts_of(ordered, stripe), trusted, round_no, dissent, ignored)
    if not fallback and len(asked) > 1:  # one candidate has nobody to be compared with: waiting cannot help
        return SourcePlan([], ignored=ignored)
    lead = [p for p in near if rounds[p] == rounds[near[0]]] if near else []
    striped = [lead[:stripe]] if stripe > 1 and len(lead) > 1 else []
    return SourcePlan(striped + [[p] for p in near], ignored=ignored)


__all__ = ["STRIPE_PEERS", "VERIFY_PEERS", "SourcePlan", "attempts_of", "plan_sources", "rank_candidates"]
