"""``NodeConfig``: every setting of a node, declared once (name, type, default, help, group), validated as a whole.

The CLI passes only the flags the user set (typer reads ``LOCOMESH_<NAME>`` env vars for the same
options, so an env value counts as set); ``load_config`` lays them over the ``--config`` file and
the defaults and validates the result, so a bad value fails with a message naming the option.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from node.config.defaults import (
    AVG, BY_REPLICAS, DEFAULT_INNER_STEPS, HELPER_BELOW, LOSSLESS_CODECS, LOSSY_FEEDBACK_DECAY, LOSSY_WARMUP_ROUNDS, OPS, PIPE,
    SPARSE_CODEC, STEPS_BY_REPLICAS, SWARM, TRAIN, by_algorithm, by_replicas_text, outer_default_text, option,
)
from node.config.combinations import check_combinations
from node.config.derived import DerivedSettings
from node.errors import UserError

def _int_or(value: Any, default: int) -> int:
    """``value`` as an int (a config file's or flag's raw value), else ``default`` (its own validator says why)."""
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


class ConfigError(UserError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class NodeConfig(DerivedSettings, BaseModel):
    """Everything a volunteer daemon needs; field names match the CLI flags (``--inner-steps`` ↔ inner_steps)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # ---- swarm ---------------------------------------------------------------------------------------
    run_id: str = option("locomesh-demo", "Name of the training run; peers of other runs never mix", SWARM,
                         pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    initial_peers: list[str] = option(list, "Multiaddr of a peer already in the swarm (repeatable)", SWARM,
                                      default_text="none: start a new swarm")
    listen: list[str] = option(lambda: ["/ip4/0.0.0.0/tcp/0"], "Multiaddr to listen on (repeatable)", SWARM)
    announce: list[str] = option(list, "Public multiaddr to announce, e.g. behind port forwarding (repeatable)", SWARM)
    identity: Path | None = option(None, "Private key file for a stable peer id: an RSA libp2p key, which also signs the node's DHT records (created if missing)", SWARM)
    swarm_key: Path | None = option(None, "Secret file of a private swarm (at least 16 bytes; hex text is decoded): peers without it are refused", SWARM)
    reachability: Literal["auto", "public", "private"] = option(
        "auto", "auto | public | private: whether others can dial this node; auto asks an initial peer to dial back, and a "
        "private node is reached through relays on public peers", SWARM)
    relay: Literal["on", "off"] = option(
        "on", "on | off: a public node relays circuits for peers behind NAT, capped at 16 circuits per peer and 1 GiB or "
        "30 min per circuit", SWARM)
    data_channel: Literal["on", "off"] = option(
        "on", "on | off: rounds' updates and state downloads between directly connected peers travel over a direct TCP "
        "connection beside p2pd (authenticated by both peers' identity keys, sealed with AES-GCM; a dense round 1.4-2.3x "
        "faster than through p2pd's streams); peers that cannot reach it (NAT, a firewall) use libp2p streams", SWARM)
    data_port: int = option(0, "TCP port of the data channel, on the address of --listen (0: any free port; peers "
                            "learn it over libp2p); forward it beside the p2pd port behind a router", SWARM, ge=0, le=65535)
    max_upload_mbit: float | None = option(
        None, "Cap on what this node sends, in Mbit/s (1 Mbit = 10^6 bits): every locomesh stream (updates, state, "
        "activations, relayed traffic) is paced below it, and round and state-download timeouts grow to fit; the DHT's "
        "own traffic in p2pd and TCP/IP headers (a few %) are not counted", SWARM, default_text="none: uncapped", gt=0)
    max_download_mbit: float | None = option(
        None, "Cap on what this node receives, in Mbit/s (10^6 bits/s), like --max-upload-mbit", SWARM,
        default_text="none: uncapped", gt=0)
    # ---- training ------------------------------------------------------------------------------------
    device: Literal["auto", "cpu", "cuda"] = option("auto", "auto | cpu | cuda; auto uses CUDA when present (bf16 autocast)", TRAIN)
    model: str = option("tiny", "Model preset: byte GPTs nano, micro, tiny, small, medium; Llama llama-tiny, llama-20m, "
                        "llama-150m, llama-1b (the vocabulary comes from --data)", TRAIN)
    model_config_file: Path | None = option(None, "A Hugging Face config.json (LlamaConfig fields) to train instead of a --model preset",
                                            TRAIN, flag="model_config")
    context: int | None = option(None, "Tokens per training sequence", TRAIN, default_text="the model's", ge=8, le=131072)
    data: Path | None = option(None, "Text file or folder to train on as bytes, or a folder of token shards from `node data prepare`",
                               TRAIN, default_text="the embedded Shakespeare corpus")
    algorithm: Literal["diloco", "noloco", "sparseloco", "zo"] = option(
        "diloco", "diloco (whole-group rounds, Nesterov outer step) | noloco (random groups of --group-size, no global barrier) | "
        "sparseloco (top-k + 2-bit pseudo-gradients, error feedback, SGD outer step) | zo (zeroth-order fine-tuning: forward "
        "passes only, one byte per step on the wire)", AVG)
    compression: str | None = option(
        None, "Codec for pseudo-gradients: none, fp16, bf16, q8, q4, q2, int8-block, topk:64/4096+q2, dct:32/4096, rot2, "
        "topk:64/4096+rot2, seed:r=16", AVG, default_text=f"none; {SPARSE_CODEC} for sparseloco")
    error_feedback_decay: float | None = option(None, "β of error feedback for lossy codecs", AVG,
                                                default_text=f"{LOSSY_FEEDBACK_DECAY}; 0 for {'/'.join(LOSSLESS_CODECS)}", ge=0, le=1)
    inner_steps: int | Literal["auto", "by-replicas"] = option(
        None, "Local steps between outer rounds (H); auto: a round is the time the swarm's median-speed peer takes for "
        "--round-steps, and every peer, fast or slow, takes the steps that fit; by-replicas (diloco, sparseloco): every peer "
        "the same H, by how many replicas averaged in the last round (the fastest waits for the slowest)", TRAIN,
        default_text=by_algorithm({**DEFAULT_INNER_STEPS, **{a: "auto" for a in STEPS_BY_REPLICAS}}))
    round_steps: int | None = option(None, "With --inner-steps auto: steps the swarm's median-speed peer takes per round", TRAIN,
                                     default_text=by_algorithm({**DEFAULT_INNER_STEPS, **{a: f"by replicas ({by_replicas_text(a)})"
                                                                                          for a in STEPS_BY_REPLICAS}}), ge=1, le=1_000_000)
    helper_below: float = option(
        HELPER_BELOW, "With --inner-steps auto (diloco, sparseloco): a node whose inner steps run below this share of the swarm's "
        "median speed for two rounds in a row stops training and helps: it keeps φ with the others' rounds, serves "
        "joiners and owns reduce-scatter parts, without sending a pseudo-gradient; 0 = always train", TRAIN, ge=0, lt=1)
    batch_size: int = option(16, "Sequences per inner step", TRAIN, ge=1, le=65536)
    lr: float = option(1e-3, "Inner learning rate (AdamW's; Muon's update is scaled to match AdamW's RMS, so the same value serves both)",
                       TRAIN, gt=0, le=10)
    warmup_steps: int = option(50, "Linear warmup of the inner lr, steps", TRAIN, ge=0)
    lr_schedule: Literal["constant", "cosine", "wsd"] = option(
        "constant", "constant | cosine | wsd: the inner lr after warm-up: constant, cosine down to --lr-floor at --total-steps, "
        "or stable then linear down to the floor over the last 20% (wsd); the position is the swarm's, so joiners continue it",
        TRAIN)
    total_steps: int | None = option(None, "Length of the lr schedule in inner steps (cosine, wsd)", TRAIN, default_text="--max-steps",
                                     ge=1)
    lr_floor: float = option(0.1, "Where cosine and wsd end, as a fraction of --lr", TRAIN, ge=0, le=1)
    inner_optimizer: Literal["adamw", "muon"] = option(
        "adamw", "adamw | muon: muon steps the blocks' 2-D weight matrices with torch.optim.Muon (RMS matched to AdamW) and the "
        "embeddings, head, norms and biases with AdamW (MuLoCo)", TRAIN)
    weight_decay: float = option(0.1, "Inner weight decay (decoupled, on matrices)", TRAIN, ge=0)
    micro_batch_size: int | None = option(
        None, "Sequences per forward/backward pass: each batch runs in pieces of at most this many, gradients accumulated, so "
        "the update is the whole batch's with less memory", TRAIN, default_text="the whole batch", ge=1, le=65536)
    activation_checkpointing: bool = option(
        False, "Recompute each transformer block's activations in the backward pass instead of storing them: less memory, about "
        "one more forward pass of compute", TRAIN)
    compile: bool | None = option(
        None, "torch.compile the model: faster steps after a slow first one (compiled kernels are kept in "
        "~/.cache/locomesh/inductor for the next start); falls back to eager with a warning if compilation fails", TRAIN,
        default_text="on with CUDA, off on the CPU")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = option(
        "default", "torch.compile's mode: reduce-overhead replays each step as CUDA graphs (llama-150m on one H100: 298k "
        "against 275k tokens/s, ~1 GB more memory; benchmarks/results/gpu/loop_cudagraphs_h100.json, commit dd8ed26)", TRAIN)
    outer_device: Literal["cpu", "same"] = option(
        "cpu", "Where the agreed weights and outer momentum live and the outer step runs: cpu (pinned host memory, leaves GPU "
        "memory to the model) | same (the model's device)", TRAIN)
    peak_tflops: float | None = option(None, "Peak dense bf16 TFLOPS of this device, for MFU (node/runtime/mfu.py holds the table)",
                                       TRAIN, default_text="looked up from the GPU's name; none on CPU", gt=0, le=100_000)
    outer_lr: float | None = option(None, "Outer learning rate η (β for noloco)", AVG, default_text=outer_default_text(0), gt=0, le=10)
    outer_momentum: float | None = option(None, "Outer momentum μ, Nesterov (α for noloco)", AVG,
                                          default_text=outer_default_text(1), ge=0, lt=1)
    outer_warmup_rounds: int | None = option(
        None, "Outer lr warm-up: round r of the run steps at η·min(1, (r+1)/W)", AVG,
        default_text=f"{LOSSY_WARMUP_ROUNDS} for diloco with a lossy codec other than seed:, else 0", ge=0, le=10_000)
    noloco_pull: float | None = option(None, "noloco: γ, pull toward the group's mean weights", AVG, default_text="the outer lr",
                                       ge=0, le=10)
    group_size: int = option(2, "noloco: members per averaging group", AVG, ge=2, le=64)
    max_group_size: int = option(
        32, "diloco/sparseloco: a swarm with more live trainers averages each round in random groups of about this many, new "
        "every round (Moshpit); such rounds average each member's stepped weights", AVG, ge=2, le=4096)
    fragments: int = option(1, "Streaming: split the model into P fragments synchronised in rotation, one every H/P steps", AVG,
                            ge=1, le=64)
    step_while_gathering: bool = option(
        True, "With --inner-steps auto (diloco, sparseloco) and blocking rounds: a node registers a little before its time "
        "budget runs out (at least one of its steps) and keeps taking inner steps until the group is complete and the budget "
        "spent, or a member asks for its update", AVG)
    overlap: bool = option(
        False, "Keep training while a round's exchange runs; the steps taken meanwhile stay on top of the round's result "
        "(a one-step-delayed outer update: it hides the round's time but costs some loss per step, docs/benchmarks.md)", AVG)
    auto_overlap: bool = option(
        False, "Start with blocking rounds and turn --overlap (asap) on once rounds block at least 10 % of the training loop "
        "over 3 rounds; it goes off for good when the next 3 rounds' inner steps per second did not rise by half the share "
        "of the loop it saved (docs/algorithms.md)", AVG)
    overlap_mode: Literal["asap", "delayed", "eager"] = option(
        "asap", "With --overlap: asap (apply a round's result when it arrives) | delayed (at the next round: one-step delay) | "
        "eager (apply an estimate from this node's Δ and the others' previous Δ at once, correct it when the result arrives); "
        "asap and eager step on while a round is due and the one before it still runs (up to twice the round's steps)", AVG)
    fragment_alpha: float = option(
        0.0, "α in θ ← (1−α)·φ + α·θ when a round's result is applied (with --overlap: θ ← θ + (1−α)(φ − θ at the round's "
        "start)); 0 replaces local weights", AVG, ge=0, le=1)
    aggregate: Literal["mean", "sparse-mean", "centered-clip", "sparse-clip", "median-clip", "trimmed-mean"] | None = option(
        None, "mean | sparse-mean | centered-clip | sparse-clip | median-clip | trimmed-mean: how updates are combined; all "
        "but the first two bound what any one peer can do to the model", AVG,
        default_text="centered-clip (sparse-clip for sparseloco); with --swarm-key: mean (sparse-mean)")
    contribution_scores: Literal["auto", "on", "off"] = option(
        "auto", "auto | on | off: before averaging a round of 3+ whole updates, score each by the loss it gives applied "
        "alone and drop those that raise it (diloco, sparseloco); auto: on in open swarms whose rounds gather whole "
        "updates (sparseloco; dense rounds that cannot reduce-scatter)", AVG)
    zo_eps: float = option(1e-3, "zo: perturbation size ε of each step's two loss evaluations at θ ± εz", AVG, gt=0, le=1)
    zo_lr: float = option(1e-4, "zo: learning rate of every one-byte step (θ moves by −lr·g·z); each peer's steps are applied, "
                          "so lower it for many peers", AVG, gt=0, le=1)
    zo_seed_pool: int = option(0, "zo: draw every step's direction from a fixed pool of K seeds (FedKSeed), so the fine-tune is "
                               "K accumulated scalars; 0: a fresh seed per step", AVG, ge=0, le=1 << 20)
    init_from: Path | None = option(
        None, "Start a new run from existing weights: a locomesh checkpoint (a checkpoint.pt a node wrote, or its "
        "--checkpoint-dir) or a Hugging Face Llama folder (config.json, model.safetensors, tokenizer.json; node export writes "
        "one). Joiners still take the swarm's state", TRAIN)
    min_peers: int = option(1, "Wait until this many peers (this one included) are in the run before the first step, at most "
                            "--join-timeout seconds, then exit; a run that already trains is joined at once (node swarm: "
                            "--nodes)", SWARM, ge=1, le=1024)
    join_timeout: float = option(60.0, "How long a joiner keeps trying to reach the swarm and download its state, and how "
                                 "long --min-peers waits, seconds", SWARM, gt=0)
    stream_timeout: float = option(30.0, "Refuse a peer that stalls mid-request this long, seconds", OPS, gt=0)
    averaging_timeout: float = option(30.0, "Longest wait for late peers in a round, seconds; the deadline adapts below it to "
                                      "recent rounds", AVG, gt=0)
    quorum: float = option(1.0, "diloco, sparseloco: once more than this share of a round's expected members registered, "
                           "the round closes a grace later (learned from how late the last members came in recent rounds) "
                           "instead of waiting to the deadline; a member that comes later follows the round and its update "
                           "enters the next one; 1 = wait for every member (the default for now: 0.5 is a strict majority)", AVG, ge=0, le=1)
    # ---- pipeline (SWARM) ----------------------------------------------------------------------------
    stages: int = option(1, "Pipeline: cut the model into S stages served by different peers (1 = whole-model replicas)", PIPE,
                         ge=1, le=64)
    role: Literal["auto", "stage", "trainer", "spare"] = option(
        "auto", "Pipeline: auto | stage | trainer | spare; auto takes what the swarm needs; a spare waits to rebuild a lost "
        "stage", PIPE)
    stage: int | None = option(None, "Pipeline: with --role stage, the stage to serve", PIPE,
                               default_text="the one the swarm needs", ge=0)
    activation_compression: str = option("none", "Pipeline: codec for activations and their gradients: none, fp16, bf16, "
                                         "int8-block, q8", PIPE)
    microbatches: int = option(4, "Pipeline trainer: microbatches in flight at once, so all stages stay busy", PIPE, ge=1, le=256)
    stage_queue: int = option(8, "Pipeline: requests a stage server lets wait before answering busy", PIPE, ge=1, le=1024)
    sync_every: float = option(30.0, "Pipeline: seconds between averaging rounds of a stage's replicas", PIPE, gt=0)
    rebalance_period: float = option(300.0, "Pipeline: seconds between rebalancing checks, 0 = never", PIPE, ge=0)
    rebalance_margin: float = option(0.1, "Pipeline: move only if pipeline throughput rises by more than this fraction", PIPE,
                                     ge=0)
    checkfree_plus: bool = option(False, "Pipeline: CheckFree+ (out-of-order microbatches, embedding/head replicas on "
                                  "neighbours) so a lost first or last stage can be restored", PIPE)
    recovery_grace: float = option(10.0, "Pipeline: seconds a stage may have no server before it is declared lost and rebuilt",
                                   PIPE, gt=0)
    recovery_lr_scale: float = option(1.1, "Pipeline: learning-rate factor of a rebuilt stage's fresh optimizer", PIPE, gt=0, le=10)
    # ---- operations ----------------------------------------------------------------------------------
    metrics_port: int = option(0, "Prometheus /metrics port, 0 = off", OPS, ge=0, le=65535)
    checkpoint_dir: Path | None = option(None, "Directory for the (atomic) checkpoint, written after the first outer round, then "
                                         "every --checkpoint-every seconds and at exit; resumed from on restart when it was "
                                         "written with the same run settings", OPS)
    checkpoint_every: float = option(300.0, "Seconds between checkpoints after outer rounds (0: after every round); a node that "
                                     "restarts catches up with the swarm by downloading its state, so only a swarm that all stops "
                                     "at once loses what the last checkpoint did not hold", OPS, ge=0)
    fresh: bool = option(False, "Start over: move an existing checkpoint in --checkpoint-dir aside instead of resuming it", OPS)
    max_steps: int | None = option(None, "Stop cleanly after this many inner steps", OPS, ge=1)
    duration: float | None = option(None, "Stop cleanly after this many seconds", OPS, gt=0)
    threads: int | None = option(None, "torch CPU threads", TRAIN, default_text="torch's choice", ge=1, le=1024)
    attack: str | None = option(
        None, "Experiments only: this node attacks the swarm, sending ATTACK[,ATTACK] instead of its honest update: samples, "
        "scale:K, sign, noise, alie, ipm, stale, concentrate; or abuses the protocol around an honest update: cap (announces a "
        "10^-300 Mbit/s upload cap), future (asks every member for 16 future rounds), relayed (floods every member with relayed "
        "streams from made-up origins), state (serves joiners a sign-flipped state); in a pipeline, a stage replica takes these "
        "and a trainer activations:K (multiplies what it sends to stages 1+ by K) (gossip/byzantine.py; node swarm --byzantine I:ATTACK)", OPS)
    slowdown: float = option(1.0, "Experiments: make every inner step this many times slower, to emulate slower hardware", OPS,
                             ge=1, le=100)
    slowdown_after: float = option(0.0, "Experiments: apply --slowdown only from this many seconds into training (a peer "
                                   "that slows down mid-run, as when its owner starts a game)", OPS, ge=0)
    seed: int = option(0, "Seed of this node's data order, and of the model's initialisation unless --init-seed; node swarm "
                       "gives node i the seed S + i", TRAIN)
    init_seed: int | None = option(None, "Seed of the model's initialisation; node swarm gives every node the same one", TRAIN,
                                   default_text="--seed")
    eval_batches: int = option(16, "Validation batches per evaluation", OPS, ge=1)
    eval_every: int = option(5, "Evaluate on the held-out split every N outer rounds (a pipeline trainer: every 10·N steps), 0 = only at exit", OPS, ge=0)
    info_file: Path | None = option(None, "Write a JSON summary here when up, after every round, and on exit", OPS)
    active_hours: str | None = option(
        None, "Take part only within these local hours, e.g. 22-07 (across midnight) or 9-17: outside them the node leaves "
        "cleanly (final checkpoint) and waits, then rejoins", OPS, default_text="always")
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "debug | info | warning | error", OPS)

    @field_validator("initial_peers", "listen", "announce")
    @classmethod
    def _maddrs(cls, value: list[str]) -> list[str]:
        for addr in value:
            if not addr.startswith("/"):
                raise ValueError(f"{addr!r} is not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...)")
        return value

    @field_validator("active_hours")
    @classmethod
    def _active_hours(cls, value: str | None) -> str | None:
        from node.config.active_hours import parse_active_hours

        return None if value is None else parse_active_hours(value).text  # raises ValueError saying the form

    @field_validator("compression")
    @classmethod
    def _codec(cls, value: str | None) -> str | None:
        from compression import get_codec

        return None if value is None else get_codec(value).spec  # raises ValueError naming the valid forms

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data: Any) -> Any:
        """H (and the auto mode's median H) default by algorithm: see ``DEFAULT_INNER_STEPS``."""
        if isinstance(data, dict):
            algorithm = data.get("algorithm") or "diloco"
            steps = DEFAULT_INNER_STEPS.get(algorithm, 50)
            by_table = algorithm in STEPS_BY_REPLICAS
            defaults = {"inner_steps": "auto" if by_table else steps, "round_steps": None if by_table else steps}
            # a value other than the default (a dump of a whole config, or an assignment, holds the default;
            # one written before auto was the default holds by-replicas and the algorithm's H)
            earlier = {"inner_steps": BY_REPLICAS, "round_steps": steps}
            set_steps = [f"--{n.replace('_', '-')}" for n in ("inner_steps", "round_steps")
                         if data.get(n) not in (None, defaults[n], str(defaults[n]), earlier[n], str(earlier[n]))]
            if set_steps and _int_or(data.get("stages"), 1) > 1:
                raise ValueError(f"{' and '.join(set_steps)} {'count' if len(set_steps) > 1 else 'counts'} a whole-model replica's steps per round; pipeline stages average "
                                 "every --sync-every seconds: set that instead (--stages > 1)")
            data = {**data}
            for name in ("inner_steps", "round_steps"):
                if data.get(name) is None:
                    data[name] = defaults[name]
        return data

    @model_validator(mode="before")
    @classmethod
    def _model_of_checkpoint(cls, data: Any) -> Any:
        """``--init-from`` a locomesh checkpoint without ``--model``: the checkpoint's model."""
        if isinstance(data, dict) and data.get("init_from") and not data.get("model"):
            from node.checkpoints.contents import checkpoint_model

            data = {**data, "model": checkpoint_model(Path(data["init_from"])) or cls.model_fields["model"].default}
        return data

    @field_validator("inner_steps", mode="before")
    @classmethod
    def _inner_steps(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("auto", BY_REPLICAS):
            return value.strip().lower()
        try:
            steps = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number of steps, 'auto' or '{BY_REPLICAS}', got {value!r}") from None
        if not 1 <= steps <= 1_000_000:
            raise ValueError(f"must lie in [1, 1000000], got {steps}")
        return steps

    @field_validator("attack")
    @classmethod
    def _attack(cls, value: str | None) -> str | None:
        from gossip.byzantine import parse_attacks

        if value is not None:
            parse_attacks(value)  # raises ValueError naming the attacks there are
        return value

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value: Path | None) -> Path | None:
        if value is not None and not Path(value).exists():
            raise ValueError(f"{value} does not exist; give the checkpoint.pt a locomesh node wrote (or its --checkpoint-dir), "
                             "or a Hugging Face model folder (node export writes one)")
        return value

    @field_validator("model_config_file")
    @classmethod
    def _model_config(cls, value: Path | None) -> Path | None:
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{value} is not a file; give a Hugging Face config.json (LlamaConfig fields)")
        return value

    @model_validator(mode="after")
    def _fits_together(self) -> "NodeConfig":
        check_combinations(self)  # node/config/combinations.py
        return self

    def _layers(self) -> int:
        """Transformer blocks of the architecture in force (a config file that cannot be read is refused later, with its reason)."""
        from swarm.models.presets import PRESETS, config_from_hf

        source = self.model_config_file
        if source is None and self.init_from is not None and (Path(self.init_from) / "config.json").is_file():
            source = Path(self.init_from) / "config.json"
        if source is not None:
            try:
                return config_from_hf(source).n_layer
            except (ValueError, OSError):
                return 1_000_000
        return PRESETS[self.model].n_layer

    @field_validator("activation_compression")
    @classmethod
    def _activation_codec(cls, value: str) -> str:
        from compression import get_codec

        spec = get_codec(value).spec
        if spec.split(":")[0] not in ("none", "fp16", "bf16", "int8-block", "q8"):
            raise ValueError(f"{value!r} is not an activation codec: use none, fp16, bf16, int8-block or q8")
        return spec

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        from swarm.models.presets import PRESETS

        if value not in PRESETS:
            raise ValueError(f"unknown model preset {value!r}; choose one of {', '.join(PRESETS)}")
        return value
