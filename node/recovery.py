"""Lost pipeline stages: notice a stage nobody serves, decide who rebuilds it, rebuild it from its
neighbours (CheckFree, CheckFree+) and hand the rebuilt stage to the node to serve.

:class:`StageRecoverer` sees the stage map through the DHT records the node's heartbeat reads
(:meth:`observe`), fetches neighbour stages through a callback, and hands a rebuilt stage back
through another; it never touches the node itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from node.metrics import NodeMetrics
from protocol.records import PeerRecord
from swarm.checkfree import lost_stages, rebuild_stage, recoverable, restore_from_replica
from swarm.model import GPTConfig
from swarm.stages import Stage

logger = logging.getLogger("locomesh.pipeline")

FetchStage = Callable[[int], tuple[Stage, PeerRecord | None]]


class StageRecoverer:
    """Watches for lost stages and rebuilds one when this node is the one to do it.

    :param stages: stages in the pipeline
    :param model_cfg: the model the stages are cut from; ``seed`` its initialisation seed
    :param plus: CheckFree+ (a lost first or last stage is copied from its neighbour's replica)
    :param grace: seconds a stage may have no server before it counts as lost
    :param fetch_stage: downloads stage ``i``'s current weights from one of its replicas
    :param new_stage: a freshly initialised stage ``i``
    :param become: starts serving a rebuilt stage ``(index, module)``
    """

    def __init__(self, stages: int, model_cfg: GPTConfig, seed: int, plus: bool, grace: float, fetch_stage: FetchStage,
                 new_stage: Callable[[int], Stage], become: Callable[[int, Stage], None], metrics: NodeMetrics,
                 event: Callable[..., None]) -> None:
        self.stages, self.model_cfg, self.seed, self.plus, self.grace = stages, model_cfg, seed, plus, grace
        self.fetch_stage, self.new_stage, self.become = fetch_stage, new_stage, become
        self.metrics, self.event = metrics, event
        self.last_served: list[float | None] = [None] * stages
        self.records: dict[str, PeerRecord] = {}

    def observe(self, records: dict[str, PeerRecord]) -> None:
        """Take the run's current DHT records (the node's heartbeat reads them)."""
        self.records = records
        now = time.monotonic()
        for rec in records.values():
            if rec.role == "stage" and 0 <= rec.stage < self.stages:
                self.last_served[rec.stage] = now

    def candidates(self, me: str, my_role: str, lost: list[int]) -> list[str]:
        """Who rebuilds a lost stage: spares (by peer id), else servers of stages with spare replicas."""
        records = dict(self.records)
        if my_role == "spare":
            records[me] = PeerRecord(peer_id=me, role="spare")
        spares = sorted(p for p, r in records.items() if r.role == "spare")
        if spares:
            return spares
        counts: dict[int, int] = {}
        for r in records.values():
            if r.role == "stage":
                counts[r.stage] = counts.get(r.stage, 0) + 1
        donors = [r for r in records.values() if r.role == "stage" and counts.get(r.stage, 0) >= 2 and r.stage not in lost]
        return [r.peer_id for r in sorted(donors, key=lambda r: (r.tokens_per_s, r.peer_id))]

    def check(self, me: str, my_role: str, my_stage: int | None) -> bool:
        """Rebuild a lost stage if this node is the one to do it; returns whether it did."""
        now = time.monotonic()
        lost = lost_stages(self.last_served, now, self.grace)
        if not lost or my_stage in lost:
            return False
        candidates = self.candidates(me, my_role, lost)
        if not candidates or candidates[0] != me:
            return False
        plan = recoverable(lost, self.stages, self.plus)
        stage = min(lost, key=lambda s: (plan[s] == "unrecoverable", s))
        since = now - (self.last_served[stage] or now)
        self.metrics.stages_lost.inc()
        self.event("stage_lost", stage=stage, unserved_s=round(since, 2), method=plan[stage], lost=lost)
        for s in lost:
            self.last_served[s] = None  # acted on; a stage counts as lost again only after it was served again
        self.recover(stage, plan[stage], since)
        return True

    def recover(self, stage: int, method: str, unserved_s: float) -> None:
        """Rebuild ``stage`` with ``method`` (checkfree, copy-plus or unrecoverable) and serve it."""
        started = time.monotonic()
        try:
            if method == "checkfree":
                (prev, prev_rec), (nxt, next_rec) = self.fetch_stage(stage - 1), self.fetch_stage(stage + 1)
                norms = (prev_rec.grad_norm if prev_rec else 0.0, next_rec.grad_norm if next_rec else 0.0)
                module = rebuild_stage(self.model_cfg, stage, self.stages, self.seed, "checkfree", prev, nxt, norms, plus=self.plus)
                detail: dict[str, Any] = {"norms": [round(n, 4) for n in norms]}
            elif method == "copy-plus":
                neighbour, _ = self.fetch_stage(1 if stage == 0 else stage - 1)
                module = restore_from_replica(self.model_cfg, stage, self.stages, self.seed, neighbour, plus=self.plus)
                detail = {"from_stage": neighbour.index}
            else:
                reason = ("adjacent stages were lost together" if 0 < stage < self.stages - 1
                          else "the first or last stage was lost without --checkfree-plus")
                logger.error("stage %d cannot be rebuilt from its neighbours: %s; no peer keeps a checkpoint of it, "
                             "so it restarts from a fresh initialisation", stage, reason)
                self.event("stage_unrecoverable", stage=stage, reason=reason, fallback="fresh initialisation (no checkpoint available)")
                module, detail = self.new_stage(stage), {"reason": reason}
        except Exception as e:
            logger.warning("could not rebuild stage %d with %s: %s; starting it fresh", stage, method, e)
            self.event("stage_recovery_failed", stage=stage, method=method, error=str(e)[:200])
            module, method, detail = self.new_stage(stage), "unrecoverable", {"error": str(e)[:200]}
        self.become(stage, module)
        duration = time.monotonic() - started
        self.metrics.recoveries.labels(method).inc()
        self.metrics.recovery_duration.observe(duration)
        self.event("stage_recovered", stage=stage, method=method, duration_s=round(duration, 3),
                   since_unserved_s=round(unserved_s + duration, 3), **detail)
