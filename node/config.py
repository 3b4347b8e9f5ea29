"""Node configuration: one validated model, merged from defaults < TOML file < LOCOMESH_* env < flags.

The CLI passes only the flags the user set (typer reads ``LOCOMESH_<NAME>`` env vars for the same
options, so an env value counts as set); ``load_config`` lays them over the ``--config`` file and
the defaults and validates the result, so a bad value fails with a message naming the option.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from node.errors import UserError

ENV_PREFIX = "LOCOMESH_"
FLAG_OF = {"model_config_file": "model_config"}  # fields whose flag differs (pydantic reserves model_config)
LOSSLESS_CODECS = ("none", "fp16", "bf16")  # no error feedback, and the outer step of dense DiLoCo


# H by algorithm: sparse rounds are cheap, so SparseLoCo syncs more often (tiny, 4 nodes × 600 steps:
# H = 20 came within 5.4 % of dense DiLoCo at H = 30, H = 30 within 8.3 %)
DEFAULT_INNER_STEPS = {"diloco": 50, "noloco": 30, "sparseloco": 30, "zo": 50}


class ConfigError(UserError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class NodeConfig(BaseModel):
    """Everything a volunteer daemon needs; field names match the CLI flags (``--inner-steps`` ↔ inner_steps)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # swarm
    run_id: str = Field("locomesh-demo", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="name of the training run")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of peers already in the swarm")
    listen: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"], description="multiaddrs to listen on")
    announce: list[str] = Field(default_factory=list, description="public multiaddrs to announce")
    identity: Path | None = Field(None, description="private key file (created if missing) for a stable peer id")
    swarm_key: Path | None = Field(None, description="shared secret file of a private swarm")
    reachability: Literal["auto", "public", "private"] = Field("auto", description="whether others can dial this node; auto: an initial peer dials it back")
    relay: Literal["on", "off"] = Field("on", description="a public node relays circuits for private peers")
    # training
    device: Literal["auto", "cpu", "cuda"] = "auto"
    model: str = "tiny"
    model_config_file: Path | None = Field(None, description="--model-config: a Hugging Face LlamaConfig-style config.json: the architecture instead of --model")
    context: int | None = Field(None, ge=8, le=131072, description="tokens per training sequence (default: the model's)")
    data: Path | None = None
    algorithm: Literal["diloco", "noloco", "sparseloco", "zo"] = "diloco"
    compression: str | None = Field(None, description="pseudo-gradient codec; default none, topk:64/4096+q2 for sparseloco")
    error_feedback_decay: float | None = Field(None, ge=0, le=1, description="β of error feedback; default 0.95 for lossy codecs, 0 for none/fp16/bf16")
    inner_steps: int | Literal["auto"] = Field(50, description="local steps per round, or auto: sized from this peer's speed; default by algorithm (DEFAULT_INNER_STEPS)")
    round_steps: int = Field(50, ge=1, le=1_000_000, description="with --inner-steps auto: steps the swarm's median peer takes per round; default by algorithm")
    batch_size: int = Field(16, ge=1, le=65536)
    lr: float = Field(1e-3, gt=0, le=10)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    micro_batch_size: int | None = Field(None, ge=1, le=65536, description="sequences per forward/backward pass; a batch runs as ceil(batch_size/m) passes with gradients accumulated (same update, less memory); default: the whole batch")
    activation_checkpointing: bool = Field(False, description="recompute each transformer block's activations in the backward pass instead of storing them")
    compile: bool = Field(False, description="torch.compile the model; falls back to eager with one warning if compilation fails")
    outer_device: Literal["cpu", "same"] = Field("cpu", description="where φ and the outer momentum live and the outer step runs: cpu (pinned host memory when training on CUDA) or same (the model's device)")
    peak_tflops: float | None = Field(None, gt=0, le=100_000, description="peak dense bf16 TFLOPS of this device for MFU; default: looked up from the GPU's name (none on CPU)")
    outer_lr: float | None = Field(None, gt=0, le=10, description="η (β for noloco); default 0.7, 1.0 for noloco, 2.0 for sparseloco")
    outer_momentum: float | None = Field(None, ge=0, lt=1, description="μ (α for noloco); default 0.9, 0.5 for noloco, 0 for sparseloco")
    outer_warmup_rounds: int | None = Field(None, ge=0, le=10_000, description="W: round r steps at η·min(1, (r+1)/W); default 5 for diloco with a lossy codec other than seed:, else 0")
    noloco_pull: float | None = Field(None, ge=0, le=10, description="γ of noloco: pull toward the group's mean weights; default = outer lr")
    group_size: int = Field(2, ge=2, le=64, description="members per noloco group")
    max_group_size: int = Field(32, ge=2, le=4096, description="diloco/sparseloco: a swarm with more live trainers averages in random groups of about this many")
    fragments: int = Field(1, ge=1, le=64, description="streaming: parameter fragments synchronised in rotation")
    overlap: bool = Field(False, description="keep training while a round's exchange runs")
    overlap_mode: Literal["asap", "delayed", "eager"] = Field("asap", description="apply a round's result as soon as it arrives, at the next round (one-step delay), or eagerly estimate it from the previous round")
    fragment_alpha: float = Field(0.0, ge=0, le=1, description="θ_f ← (1−α)·φ_f + α·θ_f when a round's result is applied")
    aggregate: Literal["mean", "sparse-mean", "median-clip", "trimmed-mean"] | None = Field(
        None, description="how a round's updates are combined; default sparse-mean for sparseloco, mean otherwise")
    zo_eps: float = Field(1e-3, gt=0, le=1, description="zo: ε of the central difference (L(θ+εz) − L(θ−εz))/(2ε)")
    zo_lr: float = Field(1e-4, gt=0, le=1, description="zo: learning rate of each one-byte step θ ← θ − lr·ĝ·z")
    zo_seed_pool: int = Field(0, ge=0, le=1 << 20, description="zo: draw directions from a fixed pool of K seeds (FedKSeed); 0: a fresh seed per step")
    init_from: Path | None = Field(None, description="start a new run from the weights of a locomesh checkpoint (checkpoint.pt or its folder) or a Hugging Face model folder")
    min_peers: int = Field(1, ge=1, le=1024, description="zo: wait until this many peers (self included) are in the run before the first step, up to --join-timeout")
    join_timeout: float = Field(60.0, gt=0, description="how long a joiner keeps trying to download the swarm's state")
    stream_timeout: float = Field(30.0, gt=0, description="a peer that stalls mid-request this long is refused, seconds")
    averaging_timeout: float = Field(30.0, gt=0, description="longest wait for late peers at a round, seconds")
    # pipeline (SWARM)
    stages: int = Field(1, ge=1, le=64, description="pipeline stages the model is cut into (1 = whole-model replicas)")
    role: Literal["auto", "stage", "trainer", "spare"] = Field("auto", description="pipeline role")
    stage: int | None = Field(None, ge=0, description="with --role stage: which stage to serve (default: the one the swarm needs)")
    activation_compression: str = Field("none", description="codec for activations and their gradients between stages")
    microbatches: int = Field(4, ge=1, le=256, description="pipeline trainer: microbatches in flight at once")
    stage_queue: int = Field(8, ge=1, le=1024, description="requests a stage server lets wait before answering busy")
    sync_every: float = Field(30.0, gt=0, description="seconds between averaging rounds of a stage's replicas")
    rebalance_period: float = Field(300.0, ge=0, description="seconds between rebalancing checks of a stage server (0 = never)")
    rebalance_margin: float = Field(0.1, ge=0, description="move only when pipeline throughput rises by more than this fraction")
    checkfree_plus: bool = Field(False, description="CheckFree+: out-of-order microbatches and embedding/head replicas on neighbours")
    recovery_grace: float = Field(10.0, gt=0, description="seconds a stage may have no server before it is declared lost")
    recovery_lr_scale: float = Field(1.1, gt=0, le=10, description="learning-rate factor of a rebuilt stage's fresh optimizer")
    # operations
    metrics_port: int = Field(0, ge=0, le=65535)
    checkpoint_dir: Path | None = None
    fresh: bool = Field(False, description="start over: move an existing checkpoint in --checkpoint-dir aside instead of resuming it")
    max_steps: int | None = Field(None, ge=1)
    duration: float | None = Field(None, gt=0)
    threads: int | None = Field(None, ge=1, le=1024)
    slowdown: float = Field(1.0, ge=1, le=100, description="experiments: make every inner step this many times slower (emulates slower hardware)")
    seed: int = Field(0, description="seed of this node's data order (and of the model's initialisation unless --init-seed)")
    init_seed: int | None = Field(None, description="seed of the model's initialisation (default: --seed); node swarm gives every node the same one")
    eval_batches: int = Field(16, ge=1)
    eval_every: int = Field(5, ge=0, description="evaluate on the held-out split every N outer rounds (0 = only at exit)")
    info_file: Path | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("initial_peers", "listen", "announce")
    @classmethod
    def _maddrs(cls, value: list[str]) -> list[str]:
        for addr in value:
            if not addr.startswith("/"):
                raise ValueError(f"{addr!r} is not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...)")
        return value

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
            steps = DEFAULT_INNER_STEPS.get(data.get("algorithm") or "diloco", 50)
            data = {**data}
            for name in ("inner_steps", "round_steps"):
                if data.get(name) is None:
                    data[name] = steps
        return data

    @field_validator("inner_steps", mode="before")
    @classmethod
    def _inner_steps(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            steps = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number of steps or 'auto', got {value!r}") from None
        if not 1 <= steps <= 1_000_000:
            raise ValueError(f"must lie in [1, 1000000], got {steps}")
        return steps

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
        memory_flags = [flag for flag, on in (("--micro-batch-size", self.micro_batch_size is not None),
                                              ("--activation-checkpointing", self.activation_checkpointing),
                                              ("--compile", self.compile)) if on]
        if memory_flags and self.stages > 1:
            raise ValueError(f"{', '.join(memory_flags)} {'is' if len(memory_flags) == 1 else 'are'} for whole-model replicas (--stages 1), "
                             "not pipelines (a pipeline trainer cuts its batches with --microbatches)")
        if self.algorithm == "zo" and (self.micro_batch_size is not None or self.activation_checkpointing):
            raise ValueError("--micro-batch-size and --activation-checkpointing do not apply to --algorithm zo (forward passes only, no gradients)")
        if self.micro_batch_size is not None and self.micro_batch_size > self.batch_size:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} is larger than --batch-size {self.batch_size}: it cuts each batch "
                             f"into pieces, so use at most {self.batch_size} (or raise --batch-size)")
        if self.algorithm == "zo":
            for wrong, why in ((self.fragments > 1, "--fragments"), (self.overlap, "--overlap"),
                               (self.compression not in (None, "none"), "--compression")):
                if wrong:
                    raise ValueError(f"{why} does not apply to --algorithm zo (it sends one byte per step and never a model)")
        elif self.min_peers > 1:
            raise ValueError("--min-peers is used by --algorithm zo; other algorithms start at once and let peers join")
        elif self.zo_seed_pool:
            raise ValueError("--zo-seed-pool is used by --algorithm zo; other algorithms send pseudo-gradients, not seeds")
        if self.overlap_mode == "eager" and self.algorithm == "noloco":
            raise ValueError("--overlap-mode eager estimates a group average: use it with diloco or sparseloco")
        if self.fragments > 1 and self.algorithm == "noloco":
            raise ValueError("--fragments works with diloco and sparseloco; noloco sends whole models (use --fragments 1)")
        if self.stages > 1 and self.init_from is not None:
            raise ValueError("--init-from starts whole-model replicas (--stages 1); a pipeline's stages start from the run's seed")
        if self.model_config_file is not None and self.init_from is not None:
            raise ValueError("--init-from a folder brings its own architecture: leave out --model-config")
        layers = self._layers()
        if self.stages > layers:
            raise ValueError(f"--stages {self.stages}: model {self.model!r} has only {layers} blocks to split")
        if self.stage is not None and self.stage >= self.stages:
            raise ValueError(f"--stage {self.stage} does not exist in a {self.stages}-stage pipeline (stages are 0..{self.stages - 1})")
        if self.stages > 1 and self.algorithm != "diloco":
            raise ValueError("pipeline stages average with --algorithm diloco (any --compression)")
        if self.fragments > layers:
            raise ValueError(f"--fragments {self.fragments}: model {self.model!r} has only {layers} blocks to split")
        steps = self.round_steps if self.inner_steps == "auto" else self.inner_steps
        if self.fragments > steps:
            raise ValueError(f"--fragments {self.fragments} needs at least as many inner steps per round, got {steps}")
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

    @property
    def codec(self) -> str:
        """The pseudo-gradient codec in force."""
        if self.compression is not None:
            return self.compression
        return "topk:64/4096+q2" if self.algorithm == "sparseloco" else "none"

    @property
    def aggregation(self) -> str:
        """How a round's updates are combined: explicit, else ``sparse-mean`` for SparseLoCo (a top-k
        coordinate one sender carried is applied undiluted; tiny, 4 nodes × 600 steps: held-out loss
        2.461 → 2.258 against dense DiLoCo's 2.084) and ``mean`` for everything else."""
        if self.aggregate is not None:
            return self.aggregate
        return "sparse-mean" if self.algorithm == "sparseloco" else "mean"

    @property
    def outer_hyper(self) -> tuple[float, float]:
        """(outer lr, outer momentum) in force for the algorithm.

        A shared-seed projection (``seed:``) carries a small part of the error-feedback residual each
        round and the residual accumulates the rest, as momentum would: outer momentum on top of it
        overshoots (nano alone, seed:r=8, 40 rounds of 15 steps: with μ = 0.9 the held-out loss fell to
        3.82 by round 17 and rose to 5.15 by round 40; with SGD, lr 1, it fell to 3.76 and was still
        falling), so DiLoCo with a projection steps like SparseLoCo. Other lossy codecs (error feedback
        on) keep half the momentum at lr 1: on nano, 2 nodes × 600 steps, the held-out loss against dense
        went from +3.0 % to +0.7 % (rot1), +0.9 % to −0.2 % (q2) and +0.1 % to −0.4 % (rot2), while
        dense DiLoCo was indifferent (2.286 with 0.7/0.9, 2.289 with 1.0/0.5).

        SparseLoCo steps at η = 2: a coordinate travels only once its error-feedback residual is among its
        chunk's largest, and ``sparse-mean`` applies it at the value its senders carried, so at η = 1 each
        round moved φ by less than the update it stood for (tiny, 4 nodes × 600 steps, H = 30: held-out
        2.270 at η 1.0, 2.200 at 1.5, 2.167 at 2.0 and 2.265 at 3.0, against dense DiLoCo's 2.137).
        NoLoCo steps with β = γ = 1 (α 0.5, inside its stability region α < γ < √(2 + α²)): 2.128 against
        2.196 with the paper's 0.7, both at H = 30."""
        lr_default, momentum_default = {"diloco": (0.7, 0.9), "noloco": (1.0, 0.5), "sparseloco": (2.0, 0.0),
                                        "zo": (1.0, 0.0)}[self.algorithm]
        if self.algorithm == "diloco" and self.codec.startswith("seed:"):
            lr_default, momentum_default = 1.0, 0.0
        elif self.algorithm == "diloco" and self.codec not in LOSSLESS_CODECS:
            lr_default, momentum_default = 1.0, 0.5
        return (
            self.outer_lr if self.outer_lr is not None else lr_default,
            self.outer_momentum if self.outer_momentum is not None else momentum_default,
        )

    @property
    def outer_warmup(self) -> int:
        """Rounds over which the outer lr warms up (``NesterovOuter.lr_at``), counted from the run's start.

        DiLoCo with a lossy codec steps at η = 1 with momentum 0.5 from its first round, where the
        pseudo-gradients are the largest: φ overshot for a round now and then (nano, 2 nodes from round
        0, 15 steps a round: a held-out spike at round 3 in 3 of 10 runs with rot2 and 1 of 6 with q2,
        3.2 → 3.7–4.1, once 6.8 in CI, while dense DiLoCo did not in 4). Warming η up over 5 rounds removed
        the spikes in the in-process simulation of those runs (4 of 4 smooth, and 2.82 instead of
        3.00–3.12 by round 5)."""
        if self.outer_warmup_rounds is not None:
            return self.outer_warmup_rounds
        lossy = self.codec not in LOSSLESS_CODECS and not self.codec.startswith("seed:")
        return 5 if self.algorithm == "diloco" and lossy else 0

    @property
    def model_seed(self) -> int:
        """The seed of the model's initialisation in force."""
        return self.seed if self.init_seed is None else self.init_seed

    def feedback_decay(self) -> float:
        """The error-feedback β in force: explicit, else 0.95 for lossy codecs and 0 for (near-)lossless ones."""
        if self.error_feedback_decay is not None:
            return self.error_feedback_decay
        return 0.0 if self.codec in LOSSLESS_CODECS else 0.95

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


def read_swarm_key(path: Path) -> bytes:
    """The secret of a private swarm: a file of at least 16 bytes (hex text is decoded)."""
    try:
        raw = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"cannot read --swarm-key {path}: {e.strerror}") from None
    try:
        key = bytes.fromhex(raw.decode())
    except (UnicodeDecodeError, ValueError):
        key = raw
    if len(key) < 16:
        raise ConfigError(
            f"--swarm-key {path} holds {len(key)} bytes; use at least 16, e.g. "
            "python -c 'import secrets; print(secrets.token_hex(32))' > swarm.key"
        )
    return key


def read_config_file(path: Path) -> dict[str, Any]:
    """Options from a TOML file (keys as flag names, with - or _)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    table = raw.get("node", raw)
    options = {k.replace("-", "_"): v for k, v in table.items()}
    return {next((f for f, flag in FLAG_OF.items() if flag == k), k): v for k, v in options.items()}


def load_config(flags: dict[str, Any], config_file: Path | None = None) -> NodeConfig:
    """Merge defaults < config file < flags/env (``flags`` holds only values that were set)."""
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(read_config_file(config_file))
    merged.update({k: v for k, v in flags.items() if v is not None and v != [] and v != ()})
    try:
        return NodeConfig(**merged)
    except ValidationError as e:
        problems = "; ".join(
            (f"--{FLAG_OF.get(str(err['loc'][0]), str(err['loc'][0])).replace('_', '-')}: " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None
