"""Prometheus metrics of one node (a registry of its own, served on ``--metrics-port``).

Every metric is documented in docs/operations.md ("Metrics"); names are prefixed ``locomesh_``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

TRAFFIC_KINDS = ("average", "state", "status", "stage")
ERROR_KINDS = ("timeout", "connection", "schema", "malformed", "frame_too_large", "version", "auth", "remote",
               "out_of_sync", "norm_outlier", "harmful_update", "internal", "poisoned", "busy")
ROUND_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class NodeMetrics:
    """All series a node exports; ``serve(port)`` starts the HTTP endpoint."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.info = Gauge("locomesh_node_info", "Constant 1, labelled with what this node is", ["peer_id", "run_id", "device", "model", "algorithm", "compression", "version"], registry=r)
        self.train_loss = Gauge("locomesh_train_loss", "Training loss of the last inner step (nats per byte)", registry=r)
        self.val_loss = Gauge("locomesh_val_loss", "Loss on the held-out split at the last evaluation (nats per byte)", registry=r)
        self.tokens = Counter("locomesh_tokens", "Tokens (bytes) trained on by this node", registry=r)
        self.tokens_per_second = Gauge("locomesh_tokens_per_second", "Training throughput over recent inner steps", registry=r)
        self.mfu = Gauge("locomesh_mfu", "Model FLOPs utilisation over recent inner steps (NaN on CPU or a GPU of unknown peak: set --peak-tflops)", registry=r)
        self.inner_steps = Counter("locomesh_inner_steps", "Local optimizer steps taken", registry=r)
        self.outer_round = Gauge("locomesh_outer_round", "Outer round this node is in", registry=r)
        self.outer_rounds = Counter("locomesh_outer_rounds", "Outer rounds finished, by result (completed, failed, alone)", ["result"], registry=r)
        self.bytes_sent = Counter("locomesh_bytes_sent", "Bytes sent on locomesh protocols, by message kind", ["kind"], registry=r)
        self.bytes_received = Counter("locomesh_bytes_received", "Bytes received on locomesh protocols, by message kind", ["kind"], registry=r)
        self.relayed_bytes = Counter("locomesh_relayed_bytes", "Bytes of locomesh protocols that went through a circuit relay (also counted in bytes_sent/received), by direction", ["direction"], registry=r)
        self.reachability = Gauge("locomesh_reachability", "1 for this node's reachability (public: others can dial it; private: behind NAT, reached through relays; unknown)", ["state"], registry=r)
        self.relay_circuits = Gauge("locomesh_relay_reservations", "Circuit relays holding a reservation for this node (private nodes)", registry=r)
        self.group_size = Gauge("locomesh_group_size", "Members (self included) whose updates were averaged in the last round", registry=r)
        self.round_duration = Histogram("locomesh_round_duration_seconds", "Wall time of the averaging part of an outer round", buckets=ROUND_BUCKETS, registry=r)
        self.comm_wait = Counter("locomesh_comm_wait_seconds", "Time the training loop stood still waiting for outer rounds", registry=r)
        self.inner_time = Counter("locomesh_inner_seconds", "Time spent in inner steps (batch and step): divided by wall time, the training share", registry=r)
        self.round_deadline = Gauge("locomesh_round_deadline_seconds", "Adaptive deadline of the last round's rendezvous", registry=r)
        self.round_inner_steps = Gauge("locomesh_round_inner_steps", "Inner steps this node takes in the current round (varies with --inner-steps auto)", registry=r)
        self.stage = Gauge("locomesh_stage", "Pipeline stage this node serves (-1: trainer or whole-model replica)", registry=r)
        self.stage_queue = Gauge("locomesh_stage_queue", "Requests waiting at this stage server", registry=r)
        self.stage_moves = Counter("locomesh_stage_moves", "Times this node moved to another stage (rebalancing)", registry=r)
        self.pipeline_steps = Counter("locomesh_pipeline_steps", "Pipeline microbatches of a trainer, by result (ok, failed)", ["result"], registry=r)
        self.microbatch_retries = Counter("locomesh_microbatch_retries", "Stage calls retried on another replica", registry=r)
        self.stages_lost = Counter("locomesh_stages_lost", "Pipeline stages this node found without any server past the grace period", registry=r)
        self.recoveries = Counter("locomesh_stage_recoveries", "Lost stages this node rebuilt, by method (checkfree, copy-plus, unrecoverable)", ["method"], registry=r)
        self.recovery_duration = Histogram("locomesh_stage_recovery_seconds", "Time to rebuild a lost stage once it was declared lost", buckets=ROUND_BUCKETS, registry=r)
        self.rendezvous_closes = Counter("locomesh_rendezvous_closes", "Rounds' rendezvous by how they ended (complete; grace: a quorum came and the round's grace passed, gossip.quorum; deadline)", ["how"], registry=r)
        self.round_wait = Gauge("locomesh_round_wait_seconds", "Time the last round spent waiting for peers at the rendezvous", registry=r)
        self.errors = Counter("locomesh_errors", "Errors by kind (timeout, connection, schema, out_of_sync, ...)", ["kind"], registry=r)
        self.peers = Gauge("locomesh_peers", "Live members of this run seen in the DHT (self included)", registry=r)
        self.state_downloads = Counter("locomesh_state_downloads", "State downloads from peers, by result", ["result"], registry=r)
        self.checkpoints = Counter("locomesh_checkpoints", "Checkpoints written", registry=r)
        for result in ("completed", "failed", "alone"):
            self.outer_rounds.labels(result)
        for how in ("complete", "grace", "deadline"):
            self.rendezvous_closes.labels(how)
        for result in ("ok", "failed"):
            self.state_downloads.labels(result)
            self.pipeline_steps.labels(result)
        self.state_downloads.labels("refused")
        self.stage.set(-1)
        self.mfu.set(float("nan"))
        for method in ("checkfree", "copy-plus", "unrecoverable"):
            self.recoveries.labels(method)
        # every known label exists from the start, so dashboards and alerts see 0 rather than no data
        for kind in TRAFFIC_KINDS:
            self.bytes_sent.labels(kind)
            self.bytes_received.labels(kind)
        for kind in ERROR_KINDS:
            self.errors.labels(kind)
        for direction in ("sent", "received"):
            self.relayed_bytes.labels(direction)
        self.set_reachability("unknown")

    def set_reachability(self, state: str) -> None:
        for s in ("public", "private", "unknown"):
            self.reachability.labels(s).set(1 if s == state else 0)

    def serve(self, port: int) -> None:
        start_http_server(port, addr="0.0.0.0", registry=self.registry)
