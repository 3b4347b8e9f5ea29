"""The trainer role of a pipeline swarm: hold the data and push microbatches through randomized
pipelines of stage servers (``swarm.router``, ``swarm.microbatch``), keeping ``--microbatches`` in
flight, retrying a failed microbatch on other replicas, and evaluating on held-out text.

:class:`PipelineTrainer` is handed the network, the run's settings and the node's summary and
metrics; the pipeline node feeds its router from the DHT records it reads each heartbeat. A trainer
holds no weights: its checkpoint (``node.pipeline.checkpoint``) is its data position and step count,
and a resumed one evaluates before its first step, so a restarted swarm shows where it resumed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from node.runtime.base import RECORD_TTL_S
from node.runtime.summary import Summary, count_steps
from node.config import NodeConfig
from node.runtime.workload import Workload
from node.runtime.metrics import NodeMetrics
from node.runtime.network import NetworkThread
from gossip.byzantine import ATTACK_AFTER_MICROBATCHES, Attacker
from swarm.models.presets import ModelConfig
from swarm.microbatch import PipelineClient, PipelineStepFailed
from swarm.router import Router

logger = logging.getLogger("locomesh.pipeline")


class PipelineTrainer:
    """Trains through the pipeline until ``stop`` is set or ``done()`` says the node's time is up.

    :param announce: publishes the node's DHT record and refreshes the router (the node's heartbeat)
    :param write_info: rewrites the node's ``--info-file``
    :param resume: the node's own trainer checkpoint (data position, steps), if any
    :param save: writes the node's checkpoint (after every evaluation; None: no --checkpoint-dir)
    """

    def __init__(self, *, cfg: NodeConfig, workload: Workload, net: NetworkThread, metrics: NodeMetrics, summary: Summary,
                 event: Callable[..., None], stop: threading.Event, done: Callable[[], bool],
                 announce: Callable[[], Awaitable[None]], write_info: Callable[[], None],
                 resume: tuple[Path, dict[str, Any]] | None = None, save: Callable[[], None] | None = None) -> None:
        self.cfg, self.workload, self.net, self.metrics, self.summary = cfg, workload, net, metrics, summary
        self.model_cfg: ModelConfig = workload.model_cfg
        self.event, self.stop, self.done, self.announce, self.write_info = event, stop, done, announce, write_info
        self.router = Router(seed=cfg.seed, ban_s=RECORD_TTL_S)
        self.throughput = 0.0  # tokens/s over the last window
        self.last_loss = math.nan
        self.tokens_per_step = cfg.batch_size * self.model_cfg.context
        self.client: PipelineClient | None = None
        self.val: list = []
        self.waiting: dict[str, Any] | None = None  # the wait for an unserved stage in progress
        self.resume, self.save = resume, save
        self.steps_before = 0  # pipeline steps of this trainer before its restart (from its checkpoint)
        self.batches: Any = None

    def run(self) -> None:
        cfg = self.cfg
        self.val = self.workload.val
        batches = self.batches = self.workload.train_batches(cfg.batch_size, cfg.seed)
        client = self.client = PipelineClient(self.net.transport, cfg.run_id, cfg.stages, self.router, cfg.activation_compression,
                                              timeout=cfg.averaging_timeout, plus=cfg.checkfree_plus, d_model=self.model_cfg.d_model)
        attacker = Attacker.from_spec(cfg.attack, seed=cfg.seed)  # experiments only: activations:K
        client.sent_scale = (attacker.param("activations") or 1.0) if attacker is not None else 1.0
        client.sent_scale_after = ATTACK_AFTER_MICROBATCHES
        self._resume_data()
        self._wait_for_stages()
        if self.resume is not None:
            self.evaluate()  # where the restarted swarm stands, before this trainer moves it
            logger.info("held-out loss at resume: %.4f", self.summary.val_loss)
        self.window, self.window_tokens = time.monotonic(), 0
        # --microbatches pipelines in flight, so every stage has work while others compute
        workers = [self.net.submit(self._microbatch_loop(client, batches)) for _ in range(cfg.microbatches)]
        next_eval = cfg.eval_every * 10
        try:
            while not self.stop.is_set() and not self.done():
                time.sleep(0.1)
                self.summary.refused_implausible = client.implausible
                for w in workers:
                    if w.done() and w.exception() is not None:
                        raise w.exception()  # type: ignore[misc]
                if cfg.eval_every and self.summary.steps >= next_eval:
                    next_eval = self.summary.steps + cfg.eval_every * 10
                    self.evaluate()
                    if self.save is not None:
                        self.save()
        finally:
            for w in workers:
                w.cancel()

    # ---- checkpoint ---------------------------------------------------------------------------------
    def _resume_data(self) -> None:
        """Continue the data where the checkpoint left it (a position of other data is reported and ignored)."""
        if self.resume is None:
            return
        path, state = self.resume
        self.steps_before = int(state.get("trainer", {}).get("steps_total", 0))
        try:
            if "data_order" in state:
                self.batches.load_state_dict(state["data_order"])
        except ValueError as e:
            logger.warning("not resuming the data position of %s: %s; starting the data from its beginning", path, e)
        self.summary.resumed_from = {"checkpoint": str(path), "steps_total": self.steps_before}
        self.event("resumed", checkpoint=str(path), steps_total=self.steps_before)

    def checkpoint_state(self) -> dict[str, Any]:
        """The trainer's entries of the node's checkpoint."""
        return {"role": "trainer", "trainer": {"steps_total": self.steps_before + self.summary.steps}}

    def data_order(self) -> dict[str, Any] | None:
        """The data position, read on the network thread where the microbatch loops draw batches."""
        if self.batches is None:
            return None

        async def read() -> dict[str, Any]:
            return self.batches.state_dict()

        return self.net.call(read(), timeout=30)

    async def _microbatch_loop(self, client: PipelineClient, batches: Any) -> None:
        """One pipeline in flight: a microbatch goes through every stage; a failed one is retried the
        same, with backoff while a stage has no server (one log line and one event per wait)."""
        while not self.stop.is_set():
            x, y = batches.next()
            backoff = 0.5
            while not self.stop.is_set():
                try:
                    result = await client.step(x, y)
                except PipelineStepFailed as e:
                    self.metrics.pipeline_steps.labels("failed").inc()
                    self._wait_started(e)
                    await asyncio.sleep(backoff)  # for the DHT to show a live (or rebuilt) replica
                    backoff = min(2 * backoff, 5.0)
                    continue
                self._wait_ended()
                self._count_step(result)
                break

    def _wait_started(self, error: PipelineStepFailed) -> None:
        """The first failure of a wait logs why; later ones are only counted."""
        if self.waiting is None:
            self.waiting = {"since": time.monotonic(), "stage": error.stage, "attempts": 0, "reason": str(error)[:300]}
            logger.warning("waiting for stage %s: %s (retrying with backoff)", "?" if error.stage is None else error.stage, error)
        self.waiting["attempts"] += 1

    def _wait_ended(self) -> None:
        """A microbatch went through: one ``waiting_for_stage`` event for the whole wait, with its duration."""
        if self.waiting is None:
            return
        waited, self.waiting = self.waiting, None
        duration = time.monotonic() - waited["since"]
        logger.info("stage %s is served again after %.1fs", waited["stage"], duration)
        self.event("waiting_for_stage", stage=waited["stage"], duration_s=round(duration, 2), attempts=waited["attempts"],
                   reason=waited["reason"], step=self.summary.steps)

    def _count_step(self, result: Any) -> None:
        m, summary = self.metrics, self.summary
        m.pipeline_steps.labels("ok").inc()
        m.microbatch_retries.inc(result.retries)
        if result.retries:
            self.event("rerouted", step=summary.steps, retries=result.retries, error=result.errors[-1][:200])
        count_steps(summary, m, 1, self.tokens_per_step, result.loss)
        for peer in result.path:
            summary.routed[peer] = summary.routed.get(peer, 0) + 1
        self.last_loss = result.loss
        self.window_tokens += self.tokens_per_step
        if time.monotonic() - self.window >= 2.0:
            self.throughput = self.window_tokens / (time.monotonic() - self.window)
            m.tokens_per_second.set(self.throughput)
            self.window, self.window_tokens = time.monotonic(), 0

    def _wait_for_stages(self) -> None:
        """Before the first microbatch: wait (up to --join-timeout) until every stage has a server."""
        deadline = time.monotonic() + self.cfg.join_timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            self.net.call(self.announce(), timeout=30)
            missing = [s for s in range(self.cfg.stages) if not self.router.peers(s)]
            if not missing:
                return
            logger.info("waiting for servers of stages %s", missing)
            time.sleep(1.0)

    def evaluate(self, final: bool = False) -> None:
        """Held-out loss through the pipeline; skipped (logged) when a stage cannot be reached."""
        client = self.client
        if client is None or not self.val:
            return
        try:
            if final:
                losses = [self.net.call(client.evaluate(vx, vy), timeout=60) for vx, vy in self.val]
            else:
                losses = [self.net.run(client.evaluate(vx, vy), self.stop) for vx, vy in self.val]
        except (PipelineStepFailed, TimeoutError) as e:
            logger.info("evaluation skipped: %s", e)
            return
        self.summary.val_loss = sum(losses) / len(losses)
        self.metrics.val_loss.set(self.summary.val_loss)
        # "t" lets a report put several trainers' evaluations on one time line (tokens through the pipeline)
        self.summary.rounds.append({"step": self.summary.steps, "val_loss": self.summary.val_loss, "loss": self.last_loss,
                                    "t": round(time.time(), 3)})
        self.write_info()
