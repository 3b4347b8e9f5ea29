"""What a node reports about itself (``--info-file``, read by ``node swarm`` and ``node status``), and the
bookkeeping that fills it: traffic by protocol kind and training steps with their loss.

The functions take the summary and the metrics they update, nothing else, so the pipeline trainer
(which is not a node) keeps its books the same way as the nodes.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.runtime.metrics import NodeMetrics


@dataclass
class Summary:
    """What the node reports when it exits (``--info-file``, read by ``node swarm``)."""

    peer_id: str = ""
    multiaddrs: list[str] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    metrics_port: int = 0
    role: str = "trainer"  # trainer | helper (replicas) | stage | spare (pipelines); what the node did last
    stage: int | None = None  # the pipeline stage it served last, None for trainers and replicas
    seed: int = 0
    steps: int = 0
    microbatches_served: int = 0  # pipeline stage servers: microbatches this node computed (one per backward or loss)
    refused_busy: int = 0  # pipeline stage servers: requests answered busy because the queue was full
    # pipelines: training requests (stage servers) or stage answers (trainers) refused for their shape or
    # for a scale far off the recent ones (swarm.plausible)
    refused_implausible: int = 0
    clipped_gradients: int = 0  # pipeline stage servers: backward requests whose gradient was scaled down to the bound
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
    checkpoint_s: float = 0.0  # time spent writing checkpoints (after rounds and at exit)
    eval_s: float = 0.0  # time the training loop spent in held-out evaluations after rounds (--eval-every)
    resumed_from: dict[str, Any] | None = None  # {"checkpoint", "round"} when the node resumed its checkpoint
    joined_round: int | None = None
    comm_wait_s: float = 0.0
    # whole-model replicas: on | off (--overlap or not); under --auto-overlap measuring | trying | on | off (node.replica.overlap_choice)
    overlap: str = "off"
    wall_s: float = 0.0  # from start-up (model, corpus, networking, join) to the end of training
    train_s: float = 0.0  # the training loop alone
    inner_s: float = 0.0  # the inner steps (batch and step) within it: inner_s / train_s is the training share
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


def count_steps(summary: Summary, metrics: NodeMetrics, steps: int, tokens: int = 0, loss: float | None = None) -> None:
    """Account ``steps`` training steps (``tokens`` tokens) and the loss of the last one (None: this
    node computed no loss, e.g. a pipeline stage other than the last)."""
    summary.steps += steps
    metrics.inner_steps.inc(steps)
    if tokens:
        metrics.tokens.inc(tokens)
    if loss is None:
        return
    if math.isnan(summary.train_loss_first):
        summary.train_loss_first = loss
    summary.train_loss_last = loss
    metrics.train_loss.set(loss)


def time_shares(summary: Summary, loop_started: float | None) -> dict[str, float | None]:
    """Shares of the training loop's wall time so far (``loop_started``: its ``time.monotonic()`` start):
    inner steps (``training_share``) and standing still for outer rounds (``blocked_share``)."""
    if loop_started is None:
        return {"training_share": None, "blocked_share": None}
    loop_s = max(time.monotonic() - loop_started, 1e-9)
    return {"training_share": round(min(summary.inner_s / loop_s, 1.0), 4),
            "blocked_share": round(min(summary.comm_wait_s / loop_s, 1.0), 4)}
