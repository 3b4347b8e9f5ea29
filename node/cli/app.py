"""The ``node`` command line: ``join`` a swarm, launch a local ``swarm``, ``status`` of a run, ``eval`` a checkpoint.

Every ``join`` option can also come from a ``LOCOMESH_<NAME>`` environment variable or a ``--config``
TOML file; flags win over env over file over defaults.
"""

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from node.config import ConfigError, NodeConfig, load_config
from node.errors import UserError

app = typer.Typer(
    name="node",
    help="locomesh: a peer-to-peer training node. Start with `node join` or try `node swarm --nodes 3`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: wraps text and never cuts a flag or variable name at 80 columns
)

SWARM, TRAIN, AVG, PIPE, OPS = "Swarm", "Training", "Averaging", "Pipeline", "Operations"


def _env(name: str) -> str:
    return "LOCOMESH_" + name.upper()


def opt(help: str, panel: str, name: str, **kw: Any) -> Any:
    return typer.Option(help=help, rich_help_panel=panel, envvar=_env(name), show_envvar=True, **kw)


def join_flags(
    config: Annotated[Optional[Path], typer.Option("--config", help="TOML file with options (flag names as keys)", rich_help_panel=OPS, envvar=_env("config"), show_envvar=True)] = None,
    run_id: Annotated[Optional[str], opt("Name of the training run; peers of other runs never mix (default: locomesh-demo)", SWARM, "run_id")] = None,
    initial_peers: Annotated[Optional[list[str]], opt("Multiaddr of a peer already in the swarm (repeatable); none = start a new swarm", SWARM, "initial_peers")] = None,
    listen: Annotated[Optional[list[str]], opt("Multiaddr to listen on (repeatable) (default: /ip4/0.0.0.0/tcp/0)", SWARM, "listen")] = None,
    announce: Annotated[Optional[list[str]], opt("Public multiaddr to announce, e.g. behind port forwarding (repeatable)", SWARM, "announce")] = None,
    identity: Annotated[Optional[Path], opt("Private key file for a stable peer id (created if missing)", SWARM, "identity")] = None,
    swarm_key: Annotated[Optional[Path], opt("Secret file of a private swarm: peers without it are refused", SWARM, "swarm_key")] = None,
    reachability: Annotated[Optional[str], opt("auto | public | private: whether others can dial this node; auto asks an initial peer to dial back, and a private node is reached through relays on public peers (default: auto)", SWARM, "reachability")] = None,
    relay: Annotated[Optional[str], opt("on | off: a public node relays circuits for peers behind NAT, capped at 16 circuits per peer and 1 GiB or 30 min per circuit (default: on)", SWARM, "relay")] = None,
    device: Annotated[Optional[str], opt("auto | cpu | cuda (default: auto)", TRAIN, "device")] = None,
    model: Annotated[Optional[str], opt("Model preset: byte GPTs nano, micro, tiny, small, medium; Llama llama-tiny, llama-20m, llama-150m, llama-1b (the vocabulary comes from --data) (default: tiny)", TRAIN, "model")] = None,
    model_config_file: Annotated[Optional[Path], typer.Option("--model-config", help="A Hugging Face config.json (LlamaConfig fields) to train instead of a --model preset", rich_help_panel=TRAIN, envvar=_env("model_config"), show_envvar=True)] = None,
    context: Annotated[Optional[int], opt("Tokens per training sequence (default: the model's)", TRAIN, "context")] = None,
    data: Annotated[Optional[Path], opt("Text file or folder to train on as bytes, or a folder of token shards from `node data prepare` (default: the embedded Shakespeare corpus)", TRAIN, "data")] = None,
    inner_steps: Annotated[Optional[str], opt("Local steps between outer rounds (H), or auto: sized from this peer's measured speed so that fast and slow peers finish a round together (default: 50; 30 for sparseloco)", TRAIN, "inner_steps")] = None,
    round_steps: Annotated[Optional[int], opt("With --inner-steps auto: steps the swarm's median-speed peer takes per round (default: 50; 30 for sparseloco)", TRAIN, "round_steps")] = None,
    batch_size: Annotated[Optional[int], opt("Sequences per inner step (default: 16)", TRAIN, "batch_size")] = None,
    lr: Annotated[Optional[float], opt("Inner AdamW learning rate (default: 1e-3)", TRAIN, "lr")] = None,
    warmup_steps: Annotated[Optional[int], opt("Linear warmup of the inner lr (default: 50)", TRAIN, "warmup_steps")] = None,
    micro_batch_size: Annotated[Optional[int], opt("Sequences per forward/backward pass: each batch runs in pieces of at most this many, gradients accumulated, so the update is the whole batch's with less memory (default: the whole batch)", TRAIN, "micro_batch_size")] = None,
    activation_checkpointing: Annotated[Optional[bool], opt("Recompute each transformer block's activations in the backward pass instead of storing them: less memory, about one more forward pass of compute (default: off)", TRAIN, "activation_checkpointing")] = None,
    compile: Annotated[Optional[bool], opt("torch.compile the model: faster steps after a slow first one; falls back to eager with a warning if compilation fails (default: off)", TRAIN, "compile")] = None,
    outer_device: Annotated[Optional[str], opt("Where the agreed weights and outer momentum live and the outer step runs: cpu (pinned host memory, leaves GPU memory to the model) | same (the model's device) (default: cpu)", TRAIN, "outer_device")] = None,
    peak_tflops: Annotated[Optional[float], opt("Peak dense bf16 TFLOPS of this device, for MFU (default: looked up from the GPU's name; none on CPU)", TRAIN, "peak_tflops")] = None,
    threads: Annotated[Optional[int], opt("torch CPU threads (default: torch's choice)", TRAIN, "threads")] = None,
    slowdown: Annotated[Optional[float], opt("Experiments: make every inner step this many times slower, to emulate slower hardware (default: 1)", OPS, "slowdown")] = None,
    seed: Annotated[Optional[int], opt("Seed of this node's data order, and of the model's initialisation unless --init-seed; node swarm gives node i the seed S + i (default: 0)", TRAIN, "seed")] = None,
    init_seed: Annotated[Optional[int], opt("Seed of the model's initialisation (default: --seed)", TRAIN, "init_seed")] = None,
    algorithm: Annotated[Optional[str], opt("diloco (whole-group rounds, Nesterov outer step) | noloco (random groups of --group-size, no global barrier) | sparseloco (top-k + 2-bit pseudo-gradients, error feedback, SGD outer step) | zo (zeroth-order fine-tuning: forward passes only, one byte per step on the wire) (default: diloco)", AVG, "algorithm")] = None,
    zo_eps: Annotated[Optional[float], opt("zo: perturbation size ε of each step's two loss evaluations at θ ± εz (default: 1e-3)", AVG, "zo_eps")] = None,
    zo_lr: Annotated[Optional[float], opt("zo: learning rate lr of every one-byte step (θ moves by −lr·g·z); each peer's steps are applied, so lower it for many peers (default: 1e-4)", AVG, "zo_lr")] = None,
    zo_seed_pool: Annotated[Optional[int], opt("zo: draw every step's direction from a fixed pool of K seeds (FedKSeed), so the fine-tune is K accumulated scalars; 0: a fresh seed per step (default: 0)", AVG, "zo_seed_pool")] = None,
    min_peers: Annotated[Optional[int], opt("zo: wait until this many peers (this one included) are in the run before the first step, at most --join-timeout seconds (default: 1)", SWARM, "min_peers")] = None,
    init_from: Annotated[Optional[Path], opt("Start a new run from existing weights: a locomesh checkpoint (a checkpoint.pt a node wrote, or its --checkpoint-dir) or a Hugging Face Llama folder (config.json, model.safetensors, tokenizer.json; node export writes one). Joiners still take the swarm's state", TRAIN, "init_from")] = None,
    compression: Annotated[Optional[str], opt("Codec for pseudo-gradients: none, fp16, bf16, q8, q4, q2, int8-block, topk:64/4096+q2, dct:32/4096, rot2, topk:64/4096+rot2, seed:r=16 (default: none; topk:64/4096+q2 for sparseloco)", AVG, "compression")] = None,
    group_size: Annotated[Optional[int], opt("noloco: members per averaging group (default: 2)", AVG, "group_size")] = None,
    max_group_size: Annotated[Optional[int], opt("diloco/sparseloco: a swarm with more live trainers averages each round in random groups of about this many, new every round (Moshpit); such rounds average each member's stepped weights (default: 32)", AVG, "max_group_size")] = None,
    noloco_pull: Annotated[Optional[float], opt("noloco: γ, pull toward the group's mean weights (default: the outer lr)", AVG, "noloco_pull")] = None,
    fragments: Annotated[Optional[int], opt("Streaming: split the model into P fragments synchronised in rotation, one every H/P steps (default: 1)", AVG, "fragments")] = None,
    overlap: Annotated[Optional[bool], opt("Keep training while a round's exchange runs (default: off)", AVG, "overlap")] = None,
    overlap_mode: Annotated[Optional[str], opt("With --overlap: asap (apply a round's result when it arrives) | delayed (at the next round: one-step delay) | eager (apply an estimate from this node's Δ and the others' previous Δ at once, correct it when the result arrives) (default: asap)", AVG, "overlap_mode")] = None,
    fragment_alpha: Annotated[Optional[float], opt("α in θ ← (1−α)·φ + α·θ when a round's result is applied; 0 replaces local weights (default: 0)", AVG, "fragment_alpha")] = None,
    error_feedback_decay: Annotated[Optional[float], opt("β of error feedback for lossy codecs (default: 0.95; 0 for none/fp16/bf16)", AVG, "error_feedback_decay")] = None,
    outer_lr: Annotated[Optional[float], opt("Outer learning rate η (β for noloco) (default: 0.7; 2.0 for sparseloco; 1.0 for noloco and for diloco with a lossy codec)", AVG, "outer_lr")] = None,
    outer_momentum: Annotated[Optional[float], opt("Outer momentum μ (α for noloco) (default: 0.9 Nesterov; 0.5 for noloco and for diloco with a lossy codec; 0 for sparseloco and seed:)", AVG, "outer_momentum")] = None,
    outer_warmup_rounds: Annotated[Optional[int], opt("Outer lr warm-up: round r of the run steps at η·min(1, (r+1)/W) (default: 5 for diloco with a lossy codec other than seed:, else 0)", AVG, "outer_warmup_rounds")] = None,
    aggregate: Annotated[Optional[str], opt("mean | sparse-mean | median-clip | trimmed-mean: how updates are combined; the last two are robust against broken or malicious peers (default: sparse-mean for sparseloco, else mean)", AVG, "aggregate")] = None,
    stages: Annotated[Optional[int], opt("Pipeline: cut the model into S stages served by different peers (1 = whole-model replicas) (default: 1)", PIPE, "stages")] = None,
    role: Annotated[Optional[str], opt("Pipeline: auto | stage | trainer | spare; auto takes what the swarm needs; a spare waits to rebuild a lost stage (default: auto)", PIPE, "role")] = None,
    stage: Annotated[Optional[int], opt("Pipeline: with --role stage, the stage to serve (default: the one the swarm needs)", PIPE, "stage")] = None,
    activation_compression: Annotated[Optional[str], opt("Pipeline: codec for activations and their gradients: none, fp16, bf16, int8-block, q8 (default: none)", PIPE, "activation_compression")] = None,
    microbatches: Annotated[Optional[int], opt("Pipeline trainer: microbatches in flight at once, so all stages stay busy (default: 4)", PIPE, "microbatches")] = None,
    stage_queue: Annotated[Optional[int], opt("Pipeline: requests a stage server lets wait before answering busy (default: 8)", PIPE, "stage_queue")] = None,
    sync_every: Annotated[Optional[float], opt("Pipeline: seconds between averaging rounds of a stage's replicas (default: 30)", PIPE, "sync_every")] = None,
    rebalance_period: Annotated[Optional[float], opt("Pipeline: seconds between rebalancing checks, 0 = never (default: 300)", PIPE, "rebalance_period")] = None,
    rebalance_margin: Annotated[Optional[float], opt("Pipeline: move only if pipeline throughput rises by more than this fraction (default: 0.1)", PIPE, "rebalance_margin")] = None,
    checkfree_plus: Annotated[Optional[bool], opt("Pipeline: CheckFree+ (out-of-order microbatches, embedding/head replicas on neighbours) so a lost first or last stage can be restored (default: off)", PIPE, "checkfree_plus")] = None,
    recovery_grace: Annotated[Optional[float], opt("Pipeline: seconds a stage may have no server before it is declared lost and rebuilt (default: 10)", PIPE, "recovery_grace")] = None,
    recovery_lr_scale: Annotated[Optional[float], opt("Pipeline: learning-rate factor of a rebuilt stage's fresh optimizer (default: 1.1)", PIPE, "recovery_lr_scale")] = None,
    join_timeout: Annotated[Optional[float], opt("How long a joiner keeps trying to download the swarm's state, seconds (default: 60)", SWARM, "join_timeout")] = None,
    stream_timeout: Annotated[Optional[float], opt("Refuse a peer that stalls mid-request this long, seconds (default: 30)", OPS, "stream_timeout")] = None,
    averaging_timeout: Annotated[Optional[float], opt("Longest wait for late peers in a round, seconds; the deadline adapts below it to recent rounds (default: 30)", AVG, "averaging_timeout")] = None,
    metrics_port: Annotated[Optional[int], opt("Prometheus /metrics port, 0 = off (default: 0)", OPS, "metrics_port")] = None,
    checkpoint_dir: Annotated[Optional[Path], opt("Directory for the (atomic) checkpoint; resumed from on restart when it was written with the same run settings", OPS, "checkpoint_dir")] = None,
    fresh: Annotated[Optional[bool], opt("Start over: move an existing checkpoint in --checkpoint-dir aside instead of resuming it", OPS, "fresh")] = None,
    max_steps: Annotated[Optional[int], opt("Stop cleanly after this many inner steps", OPS, "max_steps")] = None,
    duration: Annotated[Optional[float], opt("Stop cleanly after this many seconds", OPS, "duration")] = None,
    eval_batches: Annotated[Optional[int], opt("Validation batches per evaluation (default: 16)", OPS, "eval_batches")] = None,
    eval_every: Annotated[Optional[int], opt("Evaluate on the held-out split every N outer rounds, 0 = only at exit (default: 5)", OPS, "eval_every")] = None,
    info_file: Annotated[Optional[Path], opt("Write a JSON summary here when up and again on exit", OPS, "info_file")] = None,
    log_level: Annotated[Optional[str], opt("debug | info | warning | error (default: info)", OPS, "log_level")] = None,
) -> tuple[dict[str, Any], Optional[Path]]:
    """The join options that were set (flags or env), and the config file."""
    flags = {k: v for k, v in locals().items() if k != "config"}
    return flags, config


def _config_or_exit(flags: dict[str, Any], config: Optional[Path]) -> NodeConfig:
    from node.config import read_swarm_key

    try:
        cfg = load_config(flags, config)
        if cfg.swarm_key is not None:
            read_swarm_key(cfg.swarm_key)
        return cfg
    except ConfigError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def join(
    log_format: Annotated[str, typer.Option("--log-format", help="text | json", rich_help_panel=OPS, envvar=_env("log_format"), show_envvar=True)] = "text",
    **kwargs: Any,
) -> None:
    """Start a volunteer daemon: join (or start) a swarm and train."""
    flags, config = join_flags(**kwargs)
    cfg = _config_or_exit(flags, config)
    from node.logs import setup_logging
    from node.cli.preflight import preflight

    setup_logging(cfg.log_level, log_format)
    lock = preflight(cfg)  # bad paths, ports and devices fail here, before anything starts
    if cfg.stages > 1:  # the one place that picks the kind of node: no kind imports another
        from node.pipeline.node import PipelineNode as Node
    elif cfg.algorithm == "zo":
        from node.zo.node import ZONode as Node
    else:
        from node.replica.node import Daemon as Node
    node = Node(cfg)
    node.folder_lock = lock
    node.install_signal_handlers()
    try:
        code = node.run()
    finally:
        if lock is not None:
            lock.release()
    raise typer.Exit(code)


# typer reads the parameters from the signature: give `join` the shared option set
import inspect as _inspect

_join_params = [p for p in _inspect.signature(join).parameters.values() if p.kind is not p.VAR_KEYWORD]
_join_params += list(_inspect.signature(join_flags).parameters.values())
join.__signature__ = _inspect.Signature(_join_params)  # type: ignore[attr-defined]
join.__annotations__ = {**join_flags.__annotations__, **join.__annotations__}


def parse_join_args(args: list[str]) -> NodeConfig:
    """Validate ``node join`` arguments without starting anything (used by ``node swarm``)."""
    command = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    try:
        ctx = command.make_context("join", list(args), resilient_parsing=False)
    except Exception as e:  # click's UsageError (typer vendors click, so match by its API)
        if not hasattr(e, "format_message"):
            raise
        typer.secho(f"error: {e.format_message()}", fg="red", err=True)
        raise typer.Exit(2) from None
    params = dict(ctx.params)
    params.pop("log_format", None)
    flags, config = join_flags(**params)
    return _config_or_exit(flags, config)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": ["-h", "--help"]})
def swarm(
    ctx: typer.Context,
    nodes: Annotated[int, typer.Option(help="Daemons to launch on 127.0.0.1", min=1)] = 3,
    duration: Annotated[float, typer.Option(help="Seconds to train before stopping every node with SIGTERM", min=1)] = 120.0,
    report: Annotated[Path, typer.Option(help="Where to write the JSON report")] = Path("runs/swarm/report.json"),
    metrics_port: Annotated[int, typer.Option(help="Node i serves /metrics on P+i; 0 = pick free ports")] = 0,
    checkpoint_dir: Annotated[Optional[Path], typer.Option(help="Node i checkpoints under DIR/node<i> (default: next to the report)")] = None,
    join_interval: Annotated[float, typer.Option(help="Seconds between launching volunteers after the bootstrap node", min=0)] = 0.5,
    node_args: Annotated[Optional[list[str]], typer.Option("--node-args", help="Extra join options for one node, as INDEX:OPTIONS (repeatable), e.g. '1:--slowdown 3'")] = None,
    chaos: Annotated[Optional[list[str]], typer.Option("--chaos", help="Fault injection (repeatable): kill:stage=S:at=60s, kill:node=I:at=T, kill:random:every=45s (SIGKILL)")] = None,
    restart_killed: Annotated[Optional[float], typer.Option("--restart-killed", help="Restart killed nodes after this many seconds (default: leave them dead)")] = None,
) -> None:
    """Launch N daemons on loopback (any `node join` option is passed to each), show progress, write a report.

    Example: node swarm --nodes 3 --duration 120 --report runs/r.json --inner-steps 30
    """
    from node.ops.launcher import SwarmLauncher
    from node.logs import setup_logging

    setup_logging("info")
    import shlex

    extra = list(ctx.args)
    cfg = parse_join_args(extra)
    per_node: dict[int, list[str]] = {}
    for spec in node_args or []:
        index, _, options = spec.partition(":")
        if not index.isdigit() or int(index) >= nodes:
            typer.secho(f"error: --node-args {spec!r}: expected INDEX:OPTIONS with INDEX below --nodes {nodes}", fg="red", err=True)
            raise typer.Exit(2)
        per_node.setdefault(int(index), []).extend(shlex.split(options))
        parse_join_args(extra + per_node[int(index)])  # fail now, not in a child process
    from node.ops.chaos import parse_chaos

    try:
        actions = [parse_chaos(spec) for spec in chaos or []]
    except ValueError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    launcher = SwarmLauncher(
        nodes=nodes, duration=duration, report=report, metrics_port=metrics_port,
        run_dir=checkpoint_dir or report.parent, join_args=extra, config=cfg, join_interval=join_interval, node_args=per_node,
        chaos=actions, restart_killed=restart_killed, seed=cfg.seed,
    )
    raise typer.Exit(launcher.run())


@app.command()
def status(
    initial_peers: Annotated[list[str], typer.Option("--initial-peers", help="Multiaddr of any peer of the run (repeatable)", envvar=_env("initial_peers"))],
    run_id: Annotated[str, typer.Option(help="Run to list", envvar=_env("run_id"))] = "locomesh-demo",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table (with --watch: one line per refresh)")] = False,
    swarm_key: Annotated[Optional[Path], typer.Option(help="Secret file of a private swarm", envvar=_env("swarm_key"))] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh until Ctrl-C instead of printing once")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes with --watch", min=0.5)] = 5.0,
    count: Annotated[int, typer.Option(help="With --watch: stop after this many refreshes (0 = until Ctrl-C)", min=0)] = 0,
) -> None:
    """List the run's peers: role, device, throughput, outer round, last loss, age of their record."""
    from node.ops.status import collect_status, render_status

    from node.logs import setup_logging

    setup_logging("warning")
    from node.config import read_swarm_key

    for maddr in initial_peers:
        if not maddr.startswith("/") or "/p2p/" not in maddr:
            raise UserError(f"--initial-peers {maddr!r} is not a node multiaddr like /ip4/HOST/tcp/PORT/p2p/PEER_ID; "
                            "use one a node prints (its --info-file 'multiaddrs')")
    key = read_swarm_key(swarm_key) if swarm_key else None
    if watch:
        raise typer.Exit(_watch_status(initial_peers, run_id, key, as_json, interval, count))
    try:
        result = collect_status(initial_peers, run_id, swarm_key=key)
    except Exception as e:
        typer.secho(f"error: could not reach the swarm through {initial_peers}: {e}", fg="red", err=True)
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        render_status(result)


def _watch_status(initial_peers: list[str], run_id: str, key: Optional[bytes], as_json: bool, interval: float, count: int) -> int:
    """``node status --watch``: a table refreshed in place (rich.live), or one JSON line per refresh."""
    import time

    from node.ops.status import status_table, watch_status

    try:
        if as_json:
            watch_status(initial_peers, run_id, lambda r: print(json.dumps(r, default=str), flush=True), interval, count, swarm_key=key)
            return 0
        from rich.console import Group
        from rich.live import Live
        from rich.text import Text

        with Live(Text(f"joining the DHT through {initial_peers[0]} ..."), auto_refresh=False) as live:
            def show(result: dict[str, Any]) -> None:
                note = Text(f"updated {time.strftime('%H:%M:%S')}, every {interval:g}s; Ctrl-C to stop", style="dim")
                live.update(Group(status_table(result), note), refresh=True)

            watch_status(initial_peers, run_id, show, interval, count, swarm_key=key)
        return 0
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        typer.secho(f"error: could not reach the swarm through {initial_peers}: {e}", fg="red", err=True)
        return 1


@app.command("probe")
def probe_cmd(
    maddr: Annotated[str, typer.Argument(metavar="MADDR", help="The node's multiaddr with its peer id: /ip4/HOST/tcp/PORT/p2p/PEER_ID", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    swarm_key_file: Annotated[Optional[Path], typer.Option("--swarm-key-file", help="Secret file of the node's private swarm", envvar=_env("swarm_key"))] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds", min=0.1)] = 10.0,
) -> None:
    """Ask one node what it is doing over py-libp2p: no DHT, no hivemind, no torch (needs the lite extra)."""
    from node.config import read_swarm_key
    from node.ops.probe import ProbeError, probe, render_probe

    try:
        key = read_swarm_key(swarm_key_file) if swarm_key_file else None
    except ConfigError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    try:
        result = probe(maddr, key, timeout, swarm_key_file)
    except ProbeError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(e.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if as_json:
        print(json.dumps(result, indent=2, default=str))
    else:
        render_probe(result)


@app.command("eval")
def eval_cmd(
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint file written by a node (checkpoint.pt)")],
    data: Annotated[Optional[Path], typer.Option(help="Evaluate on this text (file or folder; tokenized with the checkpoint's tokenizer) or a token shard folder instead of the held-out split")] = None,
    weights: Annotated[str, typer.Option(help="theta (the node's last local weights) or phi (the swarm's agreed weights)")] = "theta",
    batches: Annotated[int, typer.Option(help="Evaluation batches (at most)", min=1)] = 64,
    batch_size: Annotated[int, typer.Option(help="Sequences per batch", min=1)] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Held-out loss of a saved checkpoint: nats per token (per byte for byte models) and bits per byte."""
    from node.ops.evaluate import evaluate_checkpoint
    from node.cli.preflight import check_data

    if weights not in ("theta", "phi"):
        raise UserError(f"--weights {weights!r}: use theta (the node's last local weights) or phi (the swarm's agreed weights)")
    check_data(data)
    try:
        result = evaluate_checkpoint(checkpoint, data, weights, batches, batch_size)
    except FileNotFoundError as e:
        raise UserError(f"--checkpoint {checkpoint}: {e}; give the checkpoint.pt a node wrote in its --checkpoint-dir") from None
    except (ValueError, KeyError) as e:
        raise UserError(f"--checkpoint {checkpoint}: {e}" if str(checkpoint) not in str(e) else str(e)) from None
    if as_json:
        print(json.dumps(result))
    else:
        unit = result["unit"]
        print(f"val loss {result['loss']:.4f} nats/{unit} ({result['bits_per_byte']:.3f} bits/byte) over {result['tokens']} "
              f"{unit}s{'' if unit == 'byte' else ' (' + str(result['bytes']) + ' bytes)'} of {result['data']}, round {result['round']}")


@app.command("export")
def export_cmd(
    checkpoint: Annotated[Path, typer.Option(help="Checkpoint of a --model llama-* run (checkpoint.pt, or its --checkpoint-dir)")],
    out: Annotated[Path, typer.Option(help="Folder to create (must not exist, or be empty)")],
    weights: Annotated[str, typer.Option(help="phi (the swarm's agreed weights) or theta (the node's last local weights)")] = "phi",
) -> None:
    """Write a checkpoint as a Hugging Face LlamaForCausalLM folder (config, safetensors, tokenizer)."""
    from node.checkpoints.hf_export import export_checkpoint

    print(f"wrote {export_checkpoint(checkpoint, out, weights)}: load it with transformers' AutoModelForCausalLM.from_pretrained")


@app.command()
def doctor(
    listen_port: Annotated[int, typer.Option(help="TCP port you will listen on (0 = any)", min=0, max=65535)] = 0,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    checkpoint_dir: Annotated[Path, typer.Option(help="Where checkpoints will go")] = Path("."),
    initial_peers: Annotated[Optional[list[str]], typer.Option("--initial-peers", help="A peer to test reachability and clock skew against")] = None,
    run_id: Annotated[str, typer.Option(help="Run of that peer")] = "locomesh-demo",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Check this machine (versions, p2pd, port, device, memory, disk, peers); exit 0 only if all pass."""
    from dataclasses import asdict

    from node.ops.doctor import render, run_checks
    from node.logs import setup_logging

    setup_logging("error")
    if device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device {device!r}: use auto, cpu or cuda")
    checks = run_checks(listen_port, device, checkpoint_dir, initial_peers or [], run_id)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        render(checks)
    raise typer.Exit(0 if all(c.ok for c in checks) else 1)


# `node data tokenizer | prepare` (node/cli/data.py): tokenizer training and token shards
from node.cli.data import data_app  # noqa: E402

app.add_typer(data_app, name="data")


def _debug_requested(args: list[str]) -> bool:
    level = os.environ.get("LOCOMESH_LOG_LEVEL", "")
    for i, arg in enumerate(args):
        if arg == "--log-level" and i + 1 < len(args):
            level = args[i + 1]
        elif arg.startswith("--log-level="):
            level = arg.split("=", 1)[1]
    return level.lower() == "debug"


def _fail(message: str, code: int) -> None:
    text = " ".join(message.split())  # one line, whatever the message held
    typer.secho(f"error: {text}", fg="red", err=True)
    sys.exit(code)


def main(args: Optional[list[str]] = None) -> None:
    """Run ``node``: a mistake in the user's input or environment prints one ``error:`` line and exits 2;
    a traceback only with ``--log-level debug``."""
    args = list(sys.argv[1:] if args is None else args)
    try:
        code = app(args=args, prog_name="node", standalone_mode=False)
    except UserError as e:
        if _debug_requested(args):
            raise
        _fail(str(e), 2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):  # click's usage errors (typer vendors click)
            message = e.format_message()
            if "\n" in message.strip():  # `node` alone: the help text itself
                print(message)
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            command = ctx.command_path if ctx is not None else "node"
            _fail(f"{message} (see `{command} --help`)", e.exit_code)
        if type(e).__name__ == "Abort":
            sys.exit(130)
        if _debug_requested(args):
            raise
        if isinstance(e, OSError):
            where = f" ({e.filename})" if e.filename else ""
            _fail(f"{e.strerror or e}{where}: check the paths and ports you gave", 2)
        _fail(f"unexpected {type(e).__name__}: {e}. Run again with --log-level debug for the traceback, and please report it", 1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    sys.exit(main())
