"""Lost pipeline stages: notice a stage nobody serves, decide who rebuilds it, rebuild it from its
neighbours (CheckFree, CheckFree+) and hand the rebuilt stage to the node to serve.

Recovery is coordinated and conservative:

- **Candidates in order**: spares first (by peer id), then servers of the most replicated stages
  (slowest first). A server never leaves a stage it is the last server of. Candidates further down
  the list wait ``rank × RANK_DELAY_S`` longer, so the best-placed one moves first.
- **One rebuilder per stage**: a candidate claims the stage in the DHT (``swarm.claims``); the
  earliest claim wins and the others stay. The winner then re-reads the stage map and moves only if
  the stage is still unserved and its own stage keeps a server. A winner that leaves the stage
  unserved for a whole claim period (a peer claiming every stage it sees lost and rebuilding none) is
  ignored in that stage's claims for ``IGNORE_CLAIMER_S``, so the next candidate moves.
- **Never a silent fresh start**: a rebuild whose neighbours or replica cannot be downloaded is
  retried (every replica of each neighbour, several times) and otherwise left for a later check; only a
  stage that truly cannot be rebuilt (adjacent stages lost together, or a first/last stage without
  CheckFree+) restarts from a fresh initialisation, and says so once (``stage_unrecoverable``).
- **A pipeline short of nodes says so**: when nobody can take a lost stage over, the log and the
  node's events name the missing role once.

:class:`StageRecoverer` sees the stage map through the DHT records the node's heartbeat reads
(:meth:`observe`) and acts through callbacks; it never touches the node itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from node.runtime.metrics import NodeMetrics
from protocol.records import PeerRecord
from swarm.checkfree import lost_stages, rebuild_stage, recoverable, restore_from_replica
from swarm.claims import CLAIM_TTL_S
from swarm.models.presets import ModelConfig
from swarm.stage_map import missing_roles, servers_per_stage
from swarm.stages import Stage

logger = logging.getLogger("locomesh.pipeline")

FetchStage = Callable[[int], tuple[Stage, PeerRecord | None]]
RANK_DELAY_S = 2.0  # extra wait per place in the candidate list
FETCH_ATTEMPTS = 3  # tries at downloading a rebuild's sources, each over every replica
RETRY_AFTER_S = 5.0  # a failed rebuild is tried again after this long
IGNORE_CLAIMER_S = 600.0  # a claimer that won a stage and left it unserved for a claim period is ignored this long


class StageRecoverer:
    """Watches for lost stages and rebuilds one when this node is the one to do it.

    :param stages: stages in the pipeline
    :param model_cfg: the model the stages are cut from; ``seed`` its initialisation seed
    :param plus: CheckFree+ (a lost first or last stage is copied from its neighbour's replica)
    :param grace: seconds a stage may have no server before it counts as lost
    :param fetch_stage: downloads stage ``i``'s current weights from one of its replicas (raises if none answers)
    :param new_stage: a freshly initialised stage ``i``
    :param become: starts serving a rebuilt stage ``(index, module)``
    :param claim: claims stage ``i`` in the DHT, ignoring the claims of the given peers, and returns the
        winning peer id (``swarm.claims.claim_stage``)
    :param refresh: reads the run's DHT records afresh
    """

    def __init__(self, *, stages: int, model_cfg: ModelConfig, seed: int, plus: bool, grace: float, fetch_stage: FetchStage,
                 new_stage: Callable[[int], Stage], become: Callable[[int, Stage], None], claim: Callable[[int, frozenset[str]], str],
                 refresh: Callable[[], dict[str, PeerRecord]], metrics: NodeMetrics, event: Callable[..., None],
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.stages, self.model_cfg, self.seed, self.plus, self.grace = stages, model_cfg, seed, plus, grace
        self.fetch_stage, self.new_stage, self.become = fetch_stage, new_stage, become
        self.claim, self.refresh, self.metrics, self.event, self.sleep = claim, refresh, metrics, event, sleep
        self.last_served: list[float | None] = [None] * stages
        self.records: dict[str, PeerRecord] = {}
        self.hold_off: dict[int, float] = {}  # stage → monotonic time before which this node leaves it alone
        self.short_reported: set[int] = set()
        self.won_by: dict[int, tuple[str, float]] = {}  # lost stage → (another claimer winning it, since when)
        self.ignored: dict[int, dict[str, float]] = {}  # stage → {claimer: monotonic time until its claims are ignored}

    def observe(self, records: dict[str, PeerRecord]) -> None:
        """Take the run's current DHT records (the node's heartbeat reads them)."""
        self.records = records
        now = time.monotonic()
        for rec in records.values():
            if rec.role == "stage" and 0 <= rec.stage < self.stages:
                self.last_served[rec.stage] = now
                self.short_reported.discard(rec.stage)
                self.won_by.pop(rec.stage, None)

    def candidates(self, me: str, my_role: str, my_stage: int | None, lost: list[int]) -> list[str]:
        """Who may rebuild a lost stage, best first: spares (by peer id), then servers of the most
        replicated stages (slowest first). A stage's last server is never a candidate."""
        records = dict(self.records)
        if my_role == "spare":
            records[me] = PeerRecord(peer_id=me, role="spare")
        elif my_stage is not None and me not in records:
            records[me] = PeerRecord(peer_id=me, role="stage", stage=my_stage)
        spares = sorted(p for p, r in records.items() if r.role == "spare")
        per_stage = servers_per_stage(records, self.stages)
        donors = [r for s, servers in enumerate(per_stage) if len(servers) >= 2 and s not in lost for r in servers]
        donors.sort(key=lambda r: (-len(per_stage[r.stage]), r.tokens_per_s, r.peer_id))
        return spares + [r.peer_id for r in donors]

    def check(self, me: str, my_role: str, my_stage: int | None) -> bool:
        """Rebuild a lost stage if this node is the one to do it; returns whether it now serves one."""
        now = time.monotonic()
        lost = [s for s in lost_stages(self.last_served, now, self.grace) if self.hold_off.get(s, 0.0) <= now]
        if not lost or my_stage in lost:
            return False
        order = self.candidates(me, my_role, my_stage, lost)
        if me not in order:
            if not order:  # nobody at all can take it over
                self._report_short(lost)
            return False
        plan = recoverable(lost, self.stages, self.plus)
        stage = min(lost, key=lambda s: (plan[s] == "unrecoverable", s))
        unserved = now - (self.last_served[stage] or now)
        if unserved < self.grace + order.index(me) * RANK_DELAY_S:
            return False  # better-placed candidates move first
        ignore = frozenset(p for p, until in self.ignored.get(stage, {}).items() if until > now)
        winner = self.claim(stage, ignore)
        if winner != me:
            self._lost_claim(stage, winner)
            return False
        records = self.refresh()  # the map may have changed while the claim settled
        self.observe(records)
        per_stage = servers_per_stage(records, self.stages)
        if per_stage[stage]:
            return False
        if my_stage is not None and len([r for r in per_stage[my_stage] if r.peer_id != me]) < 1:
            logger.info("not rebuilding stage %d: stage %d would lose its last server", stage, my_stage)
            self.hold_off[stage] = time.monotonic() + RETRY_AFTER_S
            return False
        self.metrics.stages_lost.inc()
        self.event("stage_lost", stage=stage, unserved_s=round(unserved, 2), method=plan[stage], lost=lost)
        if self.recover(stage, plan[stage], unserved):
            return True
        self.hold_off[stage] = time.monotonic() + RETRY_AFTER_S
        return False

    def _lost_claim(self, stage: int, winner: str) -> None:
        """Another claimer won ``stage``: wait a claim period for it to serve the stage; a winner that
        won it a claim period ago and still does not serve it is ignored from now on."""
        now = time.monotonic()
        first, since = self.won_by.get(stage, (None, now))
        if first == winner and now - since >= CLAIM_TTL_S:
            logger.warning("%s won the claim on stage %d %.0fs ago and has not served it; ignoring its claims on it for %.0fs",
                           winner, stage, now - since, IGNORE_CLAIMER_S)
            self.event("claim_ignored", stage=stage, claimer=winner, unserved_for_s=round(now - since, 1))
            self.ignored.setdefault(stage, {})[winner] = now + IGNORE_CLAIMER_S
            self.won_by.pop(stage, None)
            self.hold_off[stage] = now  # claim again at the next check
            return
        if first != winner:
            self.won_by[stage] = (winner, now)
        logger.info("stage %d is being rebuilt by %s; staying where I am", stage, winner)
        self.hold_off[stage] = now + CLAIM_TTL_S

    def _report_short(self, lost: list[int]) -> None:
        """Once per lost stage: nobody here can take it over without emptying another stage."""
        new = [s for s in lost if s not in self.short_reported]
        if not new:
            return
        self.short_reported |= set(new)
        missing = missing_roles(self.records, self.stages)
        logger.warning("pipeline short of nodes: it needs %s; the next node that joins takes that role",
                       " and ".join(missing) or f"a server for stage {new[0]}")
        self.event("pipeline_short", lost=new, missing=missing)

    def _build(self, stage: int, method: str) -> tuple[Stage, dict[str, Any]]:
        if method == "checkfree":
            (prev, prev_rec), (nxt, next_rec) = self.fetch_stage(stage - 1), self.fetch_stage(stage + 1)
            norms = (prev_rec.grad_norm if prev_rec else 0.0, next_rec.grad_norm if next_rec else 0.0)
            module = rebuild_stage(self.model_cfg, stage, self.stages, self.seed, "checkfree", prev, nxt, norms, plus=self.plus)
            return module, {"norms": [round(n, 4) for n in norms]}
        neighbour, _ = self.fetch_stage(1 if stage == 0 else stage - 1)
        module = restore_from_replica(self.model_cfg, stage, self.stages, self.seed, neighbour, plus=self.plus)
        return module, {"from_stage": neighbour.index}

    def recover(self, stage: int, method: str, unserved_s: float) -> bool:
        """Rebuild ``stage`` with ``method`` (checkfree, copy-plus or unrecoverable) and serve it; False
        when its sources could not be downloaded (nothing changes; a later check tries again)."""
        started = time.monotonic()
        if method == "unrecoverable":
            reason = ("adjacent stages were lost together" if 0 < stage < self.stages - 1
                      else "the first or last stage was lost without --checkfree-plus")
            logger.error("stage %d cannot be rebuilt from its neighbours (%s) and no peer keeps a checkpoint of it: "
                         "it restarts from a fresh initialisation", stage, reason)
            self.event("stage_unrecoverable", stage=stage, reason=reason, fallback="fresh initialisation")
            self.become(stage, self.new_stage(stage))
            self.metrics.recoveries.labels("fresh").inc()
            return True
        error = ""
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            try:
                module, detail = self._build(stage, method)
                break
            except Exception as e:  # a neighbour's replicas left or did not answer: try again, never start fresh
                error = str(e)[:200]
                logger.warning("rebuilding stage %d with %s, attempt %d of %d: %s", stage, method, attempt, FETCH_ATTEMPTS, error)
                if attempt < FETCH_ATTEMPTS:
                    self.sleep(2.0 * attempt)
        else:
            self.event("stage_recovery_failed", stage=stage, method=method, attempts=FETCH_ATTEMPTS, error=error,
                       next_try_s=RETRY_AFTER_S)
            return False
        self.become(stage, module)
        duration = time.monotonic() - started
        self.metrics.recoveries.labels(method).inc()
        self.metrics.recovery_duration.observe(duration)
        self.event("stage_recovered", stage=stage, method=method, duration_s=round(duration, 3),
                   since_unserved_s=round(unserved_s + duration, 3), attempts=attempt, **detail)
        return True
