"""The ``node`` command line: ``join`` a swarm, launch a local ``swarm``, ``status`` of a run, ``eval`` a checkpoint,
install a ``service``.

Every ``join`` option can also come from a ``LOCOMESH_<NAME>`` environment variable or a ``--config``
TOML file; flags win over env over file over defaults.
"""

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from node.cli import command_group
from node.cli.options import join_parameters
from node.config import OPS, ConfigError, NodeConfig, load_config
from node.errors import UserError

app = command_group("node", "locomesh: a peer-to-peer training node. Start with `node join` or try `node swarm --nodes 3`.")

def _env(name: str) -> str:
    return "LOCOMESH_" + name.upper()


def join_flags(config: Optional[Path] = None, **flags: Any) -> tuple[dict[str, Any], Optional[Path]]:
    """The join options that were set (flags or env), and the config file."""
    return flags, config


# `node join`'s options are generated from NodeConfig (node.cli.options): each setting is declared once
_CONFIG_PARAM = inspect.Parameter(
    "config", inspect.Parameter.KEYWORD_ONLY, default=None,
    annotation=Annotated[Optional[Path], typer.Option("--config", help="TOML file with options (flag names as keys)",
                                                      rich_help_panel=OPS, envvar=_env("config"), show_envvar=True)])
join_flags.__signature__ = inspect.Signature([_CONFIG_PARAM, *join_parameters()])  # type: ignore[attr-defined]
join_flags.__annotations__ = {p.name: p.annotation for p in join_flags.__signature__.parameters.values()}  # type: ignore[attr-defined]


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
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the memory estimate of these options against this machine's free RAM/VRAM and exit: 0 if it fits, 2 if not; joins nothing", rich_help_panel=OPS)] = False,
    **kwargs: Any,
) -> None:
    """Start a volunteer daemon: join (or start) a swarm and train."""
    flags, config = join_flags(**kwargs)
    cfg = _config_or_exit(flags, config)
    from node.logs import setup_logging
    from node.cli.preflight import check_memory, preflight

    if dry_run:
        raise typer.Exit(check_memory(cfg, show=True))
    setup_logging(cfg.log_level, log_format)
    from node.cli import active

    supervising = cfg.active_hours is not None and not os.environ.get(active.SUPERVISED_ENV)
    if supervising:
        active.check_memory(cfg)
    else:
        check_memory(cfg)  # out of memory hours later becomes one line now
    lock = preflight(cfg)  # bad paths, ports and devices fail here, before anything starts
    if supervising:
        if lock is not None:
            lock.release()  # each window's `node join` takes it
        raise typer.Exit(active.supervise(str(cfg.active_hours)))
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
    params.pop("dry_run", None)
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
    byzantine: Annotated[Optional[list[str]], typer.Option("--byzantine", help="Experiments: node I attacks the swarm, as I:ATTACK[,ATTACK] (repeatable), e.g. '1:scale:50' or '2:alie'; attacks: samples, scale:K, sign, noise, alie, ipm, stale, concentrate")] = None,
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
    for spec in byzantine or []:
        index, _, attack = spec.partition(":")
        if not index.isdigit() or int(index) >= nodes or not attack:
            typer.secho(f"error: --byzantine {spec!r}: expected I:ATTACK with I below --nodes {nodes}, e.g. 1:scale:50", fg="red", err=True)
            raise typer.Exit(2)
        per_node.setdefault(int(index), []).extend(["--attack", attack])
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
    out: Annotated[Path, typer.Option(help="Folder to create (must not exist, or be empty)")],
    checkpoint: Annotated[Optional[Path], typer.Option(help="Checkpoint of a --model llama-* run (checkpoint.pt, or its --checkpoint-dir)")] = None,
    weights: Annotated[str, typer.Option(help="phi (the swarm's agreed weights) or theta (the node's last local weights)")] = "phi",
    initial_peers: Annotated[Optional[list[str]], typer.Option("--initial-peers", metavar="<maddr>", help="Instead of --checkpoint: export a live pipeline run (--stages > 1), asking a server of each stage for its weights; the multiaddr of any of its peers (repeatable)")] = None,
    run_id: Annotated[str, typer.Option(help="With --initial-peers: the pipeline's run")] = "locomesh-demo",
    data: Annotated[Optional[Path], typer.Option(help="With --initial-peers: the token shard folder the run trains on (its tokenizer.json goes into the export)")] = None,
    swarm_key_file: Annotated[Optional[Path], typer.Option("--swarm-key-file", help="Secret file of the run's private swarm", envvar=_env("swarm_key"))] = None,
) -> None:
    """Write a checkpoint, or a live pipeline's stages, as a Hugging Face LlamaForCausalLM folder (config, safetensors, tokenizer)."""
    if (checkpoint is None) == (not initial_peers):
        raise UserError("give either --checkpoint (a node's checkpoint) or --initial-peers (a live pipeline run), not both")
    if initial_peers:
        from node.config import read_swarm_key
        from node.ops.pipeline_export import export_pipeline

        if weights != "phi":
            raise UserError("a live pipeline's servers share each stage's agreed weights: leave out --weights with --initial-peers")
        key = read_swarm_key(swarm_key_file) if swarm_key_file else None
        written = export_pipeline(run_id=run_id, initial_peers=initial_peers, out=out, data=data, swarm_key=key)
    else:
        from node.checkpoints.hf_export import export_checkpoint

        written = export_checkpoint(checkpoint, out, weights)  # type: ignore[arg-type]
    print(f"wrote {written}: load it with transformers' AutoModelForCausalLM.from_pretrained")


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

# `node service install | remove` (node/cli/service.py): a systemd user unit around `node join`
from node.cli.service import service_app  # noqa: E402

app.add_typer(service_app, name="service")


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
    from node.cli import active

    active.invocation = args  # --active-hours runs `node join` again with them, once per window
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
