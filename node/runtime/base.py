"""What every kind of node shares: identity and summary, events, traffic accounting, stop signals,
heartbeat timing, network start-up and the line that tells others how to join.

``Daemon`` (whole-model replicas, ``node.replica.node``) and ``PipelineNode`` (stages, ``node.pipeline.node``)
both build on :class:`NodeBase`; neither imports the other (the CLI picks one in ``node.launch``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.config import NodeConfig, read_swarm_key
from node.errors import UserError
from node.runtime.metrics import NodeMetrics
from node.runtime.network import NetworkThread

logger = logging.getLogger("locomesh.node")
HEARTBEAT_S = 2.0
RECORD_TTL_S = 8.0


@dataclass
class Summary:
    """What the node reports when it exits (``--info-file``, read by ``node swarm``)."""

    peer_id: str = ""
    multiaddrs: list[str] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    metrics_port: int = 0
    role: str = "trainer"  # trainer | stage | spare (pipelines); what the node did last
    stage: int | None = None  # the pipeline stage it served last, None for trainers and replicas
    seed: int = 0
    steps: int = 0
    microbatches_served: int = 0  # pipeline stage servers: microbatches this node computed (one per backward or loss)
    refused_busy: int = 0  # pipeline stage servers: requests answered busy because the queue was full
    routed: dict[str, int] = field(default_factory=dict)  # pipeline trainers: microbatches sent to each stage peer
    route_throughput: dict[str, float] = field(default_factory=dict)  # pipeline trainers: the router's speed estimate per peer
    outer_rounds: int = 0
    train_loss_first: float = math.nan
    train_loss_last: float = math.nan
    val_loss: float = math.nan
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_sent_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_relayed: dict[str, int] = field(default_factory=dict)  # {"sent", "received"}: bytes over circuit relays
    reachability: str = "unknown"  # public | private | unknown (node.runtime.reachability)
    reachability_detail: str = ""  # how it was found, in words
    bytes_received_by_kind: dict[str, int] = field(default_factory=dict)
    checkpoint: str = ""
    resumed_from: dict[str, Any] | None = None  # {"checkpoint", "round"} when the node resumed its checkpoint
    joined_round: int | None = None
    comm_wait_s: float = 0.0
    wall_s: float = 0.0  # from start-up (model, corpus, networking, join) to the end of training
    train_s: float = 0.0  # the training loop alone
    tokens_per_s: float = 0.0  # tokens per second of the inner steps, outer rounds left out
    val_bits_per_byte: float | None = None  # the held-out loss in bits per UTF-8 byte, whatever the tokenizer
    mfu: float | None = None  # model FLOPs utilisation at that rate (node.runtime.mfu); None on CPU or an unknown GPU
    peak_mem_mb: float | None = None  # peak CUDA memory allocated, or peak RSS on the CPU
    rounds: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    state: str = "starting"


def count_traffic(metrics: NodeMetrics, summary: Summary, protocol: str, direction: str, nbytes: int,
                  path: str = "direct") -> None:
    """Account one stream's bytes by protocol kind (``/locomesh/<kind>/1.0``) in metrics and summary;
    bytes of a stream over a circuit relay (``path="relay"``) are also counted as relayed."""
    kind = protocol.split("/")[2] if protocol.count("/") >= 3 else protocol
    if path == "relay":
        metrics.relayed_bytes.labels(direction).inc(nbytes)
        summary.bytes_relayed[direction] = summary.bytes_relayed.get(direction, 0) + nbytes
    if direction == "sent":
        metrics.bytes_sent.labels(kind).inc(nbytes)
        summary.bytes_sent += nbytes
        by_kind = summary.bytes_sent_by_kind
    else:
        metrics.bytes_received.labels(kind).inc(nbytes)
        summary.bytes_received += nbytes
        by_kind = summary.bytes_received_by_kind
    by_kind[kind] = by_kind.get(kind, 0) + nbytes


def write_info(info_file: Path | None, summary: Summary) -> None:
    """Write the node's summary (``--info-file``) atomically."""
    if info_file is None:
        return
    path = Path(info_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(summary.__dict__, default=str, allow_nan=True))
    os.replace(tmp, path)


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM/SIGINT set ``stop``: the node finishes its step, evaluates, checkpoints and leaves."""

    def _handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            return
        logger.info("received %s: stopping at the next step boundary", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def _address_rank(maddr: str) -> int | None:
    """0 for a public address, 1 for a private (LAN) one, None for loopback, link-local or unknown."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return 1 if len(parts) > 1 and parts[1].startswith("dns") else None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
        return None
    return 1 if ip.is_private else 0


def dialable_addresses(maddrs: list[str]) -> list[str]:
    """The addresses to give to people on other machines: public ones first, then relayed ones
    (``/p2p-circuit``), then LAN ones; loopback only when nothing else is there."""
    ranked = []
    for i, maddr in enumerate(maddrs):
        rank = 0.5 if "/p2p-circuit" in maddr else _address_rank(maddr)
        if rank is not None:
            ranked.append((rank, i, maddr))
    return [m for _, _, m in sorted(ranked)] or list(maddrs[:1])


class NodeBase:
    """What every kind of node shares: config, stop event, metrics, summary, network thread, events."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.stop = threading.Event()
        self.metrics = NodeMetrics()
        self.summary = Summary(metrics_port=cfg.metrics_port, seed=cfg.seed)
        self.net = NetworkThread()
        self.bytes_lock = threading.Lock()
        self._traffic_marks: dict[str, tuple[int, int]] = {}
        self.started = time.monotonic()
        self.last_loss = math.nan
        self.folder_lock: Any = None  # the checkpoint folder's lock (node.checkpoints.folder_lock), named with our peer id once known

    def event(self, kind: str, **fields: Any) -> None:
        self.summary.events.append({"t": time.time(), "event": kind, **fields})
        logger.info("%s %s", kind, " ".join(f"{k}={v}" for k, v in fields.items()))

    def _on_bytes(self, protocol: str, direction: str, nbytes: int, path: str = "direct") -> None:
        with self.bytes_lock:
            count_traffic(self.metrics, self.summary, protocol, direction, nbytes, path)

    def traffic_since_last(self, kind: str) -> tuple[int, int]:
        """(bytes sent, bytes received) on protocol ``kind`` since the previous call for that kind."""
        with self.bytes_lock:
            now = (self.summary.bytes_sent_by_kind.get(kind, 0), self.summary.bytes_received_by_kind.get(kind, 0))
        before = self._traffic_marks.get(kind, (0, 0))
        self._traffic_marks[kind] = now
        return now[0] - before[0], now[1] - before[1]

    def _on_error(self, protocol: str, code: str, peer: str) -> None:
        self.metrics.errors.labels(code).inc()

    def _write_info(self) -> None:
        write_info(self.cfg.info_file, self.summary)

    def install_signal_handlers(self) -> None:
        install_stop_handlers(self.stop)

    def _deadline_reached(self) -> bool:
        cfg = self.cfg
        if cfg.max_steps is not None and self.summary.steps >= cfg.max_steps:
            return True
        return cfg.duration is not None and time.monotonic() - self.started >= cfg.duration

    def _prepare_local(self) -> tuple[Any, Any, Any]:
        """What a whole-model node needs before networking: threads, seeds, device, and its workload
        (model config, data, held-out batches ``self.val``); returns (device, model config, workload)."""
        import random

        import torch

        from node.runtime.local_training import pick_device
        from node.runtime.workload import load_workload

        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        random.seed(cfg.seed)
        device = pick_device(cfg.device)
        self.workload = load_workload(cfg)
        self.val = self.workload.val
        logger.info("training %s (%s parameters) on %s", type(self.workload.model_cfg).__name__.replace("Config", ""),
                    f"{_param_count(self.workload.model_cfg):,}", self.workload.source)
        return device, self.workload.model_cfg, self.workload

    def _record_val_loss(self, loss: float) -> None:
        """The held-out loss (nats per token, or per byte for byte-level data) and its bits per byte."""
        self.summary.val_loss = loss
        self.summary.val_bits_per_byte = self.workload.bits_per_byte(loss)
        self.metrics.val_loss.set(loss)

    def _trainer_options(self) -> dict[str, Any]:
        """The memory and speed options of :class:`node.runtime.local_training.LocalTrainer` (the config refuses the
        ones that do not apply to the node's kind)."""
        cfg = self.cfg
        return {"micro_batch_size": cfg.micro_batch_size, "activation_checkpointing": cfg.activation_checkpointing,
                "compile": cfg.compile}

    def _start_throughput(self, device: Any, model_cfg: Any) -> None:
        """What MFU needs: the model's FLOPs per token and the device's peak (``--peak-tflops`` or the table)."""
        from node.runtime.mfu import flops_per_token, peak_flops

        self.device = device
        self.flops_per_token = flops_per_token(model_cfg)
        self.peak_flops = peak_flops(device, self.cfg.peak_tflops)

    def _record_throughput(self, recent_tokens_per_s: float | None = None, inner_tokens_per_s: float | None = None) -> None:
        """Export the MFU of the recent rate (``locomesh_mfu``) and put the inner steps' rate, its MFU and
        the peak memory in the summary."""
        from node.runtime.mfu import mfu, peak_memory_mb

        if recent_tokens_per_s is not None:
            value = mfu(self.flops_per_token, recent_tokens_per_s, self.peak_flops)
            self.metrics.mfu.set(math.nan if value is None else value)
        if inner_tokens_per_s is not None:
            self.summary.tokens_per_s = inner_tokens_per_s
            self.summary.mfu = mfu(self.flops_per_token, inner_tokens_per_s, self.peak_flops)
        self.summary.peak_mem_mb = round(peak_memory_mb(self.device), 1)

    def _start_network(self) -> bool:
        """Start p2pd and the DHT; False (after logging why) when it cannot."""
        cfg = self.cfg
        try:
            self.net.start(
                cfg.initial_peers, cfg.listen, cfg.announce, str(cfg.identity) if cfg.identity else None,
                on_bytes=self._on_bytes, on_error=self._on_error,
                swarm_key=read_swarm_key(cfg.swarm_key) if cfg.swarm_key else None, stream_timeout=cfg.stream_timeout,
                join_timeout=cfg.join_timeout, stop=self.stop, reachability=cfg.reachability,
                relay_service=cfg.relay == "on",
            )
        except UserError:
            self.net.shutdown()
            raise
        except Exception as e:
            logger.error("could not start networking: %s. Check --listen/--initial-peers and that the port is free.", e)
            self.net.shutdown()
            return False
        if self.folder_lock is not None and self.net.transport is not None:
            self.folder_lock.set_peer(self.net.transport.peer_id)
        found = self.net.reachability
        self.summary.reachability, self.summary.reachability_detail = found.state, found.detail
        self.metrics.set_reachability(found.state)
        self.event("reachability", state=found.state, detail=found.detail)
        return True

    async def _refresh_addresses(self) -> None:
        """Once per heartbeat: this node's current multiaddrs (a private node's relay addresses appear
        once a relay holds a reservation for it), for its record and info file."""
        maddrs = await self.net.refresh_relays()
        peer_id = self.summary.peer_id
        self.summary.multiaddrs = [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in maddrs]
        self.metrics.relay_circuits.set(len(self.net.reachability.relays))

    def _own_multiaddrs(self) -> list[str]:
        """This node's visible multiaddrs, each ending in ``/p2p/<peer id>``."""
        net, peer_id = self.net, self.summary.peer_id
        assert net.p2p is not None
        return [str(a) if "/p2p/" in str(a) else f"{a}/p2p/{peer_id}" for a in net.call(net.p2p.get_visible_maddrs(latest=True))]

    def _print_join_hint(self, what: str, extra: str = "") -> None:
        """The line that tells a volunteer on another machine how to join this node's run."""
        peers = " ".join(f"--initial-peers {a}" for a in dialable_addresses(self.summary.multiaddrs)[:2])
        print(f"locomesh node {self.summary.peer_id} is up{what}. Others can join with:\n"
              f"  node join --run-id {self.cfg.run_id}{extra} {peers}", flush=True)


def _param_count(model_cfg: Any) -> int:
    from swarm.models.presets import num_params

    return num_params(model_cfg)
