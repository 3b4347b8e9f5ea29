"""A member that reached a round's rendezvous after its group closed: it follows the round instead of averaging alone.

A member delayed past the others' rendezvous deadline (a stalled machine, a laptop that slept, a long
pause of its process) registers after they closed their group without it. Each of them then refuses its
request for their contribution (``protocol.errors.GroupClosed``, counted as ``late``): every member
agrees on who contributed, and the late one is not among them. Before this, the late member averaged
alone, drifted from the swarm's φ and lost its work twice: the late round's update, and the next round's,
thrown away by the resync that the next fingerprint vote forced.

Now, when most of the other members it asked refused it as late, the member does not step φ. It
downloads the round's state from those members (majority-checked, ``node.replica.joiner``) and keeps
its own work on top: θ becomes the round's new φ minus its own decoded update, and that round's samples
count in its next contribution, so the late update enters the next round weighted by the tokens it
holds (not lost, and not counted twice: error feedback already holds what the lossy codec left out).

A refusal is a peer's claim. One liar among honest members that served this one is outvoted (a strict
majority is needed); a majority of liars could at most make it download the state it would have been
resynced to anyway.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from gossip.failures import LATE


def closed_without_me(others: Sequence[str], failures: Mapping[str, str]) -> list[str]:
    """The members of ``others`` (the group's other members this one asked) whose group closed without this
    member, when they are a strict majority of ``others``; else none (the round goes on as usual)."""
    closers = sorted(p for p in others if failures.get(p) == LATE)
    return closers if len(closers) * 2 > len(others) else []
