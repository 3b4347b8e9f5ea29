"""The stage map of a pipeline run, read from its DHT records: who serves each stage, which role a
pipeline short of nodes is missing (so ``node status`` and the log can say what the next joiner
should be), and which role a joiner with ``--role auto`` takes.

A record outlives its peer by up to its TTL, so a joiner that picks a role from one read can take a
server that was just killed for alive and leave its stage empty. :func:`refreshed_records` keeps the
records whose expiry moved between two reads a heartbeat or more apart: a live peer re-announces
itself every heartbeat, a dead one cannot."""

from __future__ import annotations

from protocol.records import PeerRecord
from swarm.router import MAX_MULTIPLE_OF_MEDIAN


def servers_per_stage(records: dict[str, PeerRecord] | list[PeerRecord], stages: int) -> list[list[PeerRecord]]:
    """The stage servers of each stage 0..stages-1."""
    values = records.values() if isinstance(records, dict) else records
    out: list[list[PeerRecord]] = [[] for _ in range(stages)]
    for rec in values:
        if rec.role == "stage" and 0 <= rec.stage < stages:
            out[rec.stage].append(rec)
    return out


def refreshed_records(first: dict[str, tuple[PeerRecord, float]], second: dict[str, tuple[PeerRecord, float]]) -> list[PeerRecord]:
    """The records of ``second`` (peer → (record, DHT expiry)) whose peer announced itself after
    ``first`` was read: new peers, and peers whose expiry moved on. Read the two at least one heartbeat
    apart."""
    return [rec for peer, (rec, expiry) in second.items() if peer not in first or expiry > first[peer][1]]


def missing_roles(records: dict[str, PeerRecord] | list[PeerRecord], stages: int) -> list[str]:
    """What the pipeline lacks to train: a server for each unserved stage that no spare is there to
    take over, and a trainer when there is none. Empty when it can train."""
    values = list(records.values() if isinstance(records, dict) else records)
    per_stage = servers_per_stage(values, stages)
    spares = sum(1 for r in values if r.role == "spare")
    donors = sum(len(p) - 1 for p in per_stage if len(p) > 1)  # servers that can move without emptying a stage
    unserved = [s for s in range(stages) if not per_stage[s]]
    missing = [f"a server for stage {s}" for s in unserved[spares + donors:]]
    if not any(r.role == "trainer" for r in values):
        missing.append("a trainer")
    return missing


def choose_role(records: list[PeerRecord], stages: int) -> int | None:
    """``--role auto``: the stage to serve, or None to be a trainer: a stage nobody serves, else a
    trainer when trainers are fewer than the thinnest stage's replicas, else the stage with the least
    total throughput."""
    per_stage = servers_per_stage(records, stages)
    empty = [s for s in range(stages) if not per_stage[s]]
    if empty:
        return empty[0]
    trainers = sum(1 for r in records if r.role == "trainer")
    if trainers < min(len(p) for p in per_stage):
        return None
    known = sorted(r.tokens_per_s for p in per_stage for r in p if r.tokens_per_s > 0)
    cap = MAX_MULTIPLE_OF_MEDIAN * known[(len(known) - 1) // 2] if known else float("inf")  # a throughput is a claim
    totals = [sum(min(max(r.tokens_per_s, 1e-3), cap) for r in p) for p in per_stage]
    return min(range(stages), key=lambda s: (totals[s], s))
