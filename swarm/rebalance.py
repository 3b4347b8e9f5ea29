"""Rebalancing (SWARM §3.2; Petals does the same for blocks): move capacity to the bottleneck stage.

A pipeline runs at the speed of its slowest stage, i.e. the stage whose peers' summed throughput is
lowest. Periodically each stage server reads every stage's peers from the DHT; exactly one peer, the
slowest of the stage with the most spare throughput, moves to the bottleneck stage, and only when
that raises the pipeline's throughput by more than ``margin`` (so two nearly equal stages do not
trade a peer back and forth). A stage's last peer never leaves it, and nobody moves while some
server has not measured its throughput yet (a peer that just moved or joined): plans made on a
guess flap. The node also waits a full period after any server joined or moved before planning.
"""

from __future__ import annotations


def pipeline_throughput(stages: list[dict[str, float]]) -> float:
    """Samples/s the pipeline sustains: the minimum over stages of the stage's summed throughput."""
    return min((sum(peers.values()) for peers in stages), default=0.0)


def plan_move(stages: list[dict[str, float]], me: str, margin: float = 0.1) -> int | None:
    """The stage ``me`` should move to, or None to stay.

    :param stages: per stage, {peer: throughput}
    """
    totals = [sum(peers.values()) for peers in stages]
    mine = next((s for s, peers in enumerate(stages) if me in peers), None)
    if mine is None or len(stages) < 2 or any(tp <= 0 for peers in stages for tp in peers.values()):
        return None
    # ties: lowest stage index, so every peer computes the same plan
    donor = max(range(len(stages)), key=lambda s: (totals[s], -s))
    target = min(range(len(stages)), key=lambda s: (totals[s], s))
    if mine != donor or donor == target or len(stages[donor]) < 2:
        return None
    mover = min(stages[donor], key=lambda p: (stages[donor][p], p))
    if mover != me:
        return None
    after = list(totals)
    after[donor] -= stages[donor][me]
    after[target] += stages[donor][me]
    return target if min(after) > min(totals) * (1 + margin) else None
