"""The ``node`` command line: ``join`` a swarm, launch a local ``swarm``, and the entry point (:func:`main`) that
turns every mistake into one ``error:`` line. The read-only commands (``status``, ``probe``, ``eval``,
``export``, ``doctor``) are in ``node.cli.inspection``, ``data`` and ``service`` in their own modules.

Every ``join`` option can also come from a ``LOCOMESH_<NAME>`` environment variable or a ``--config``
TOML file; flags win over env over file over defaults.
"""

import inspect
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from node.cli import command_group, env_var, inspection
from node.cli.options import join_parameters
from node.config import OPS, ConfigError, NodeConfig, load_config
from node.errors import UserError

app = command_group("node", "locomesh: a peer-to-peer training node. Start with `node join` or try `node swarm --nodes 3`.")

def join_flags(config: Optional[Path] = None, **flags: Any) -> tuple[dict[str, Any], Optional[Path]]:
    """The join options that were set (flags or env), and the config file."""
    return flags, config


# `node join`'s options are generated from NodeConfig (node.cli.options): each setting is declared once
_CONFIG_PARAM = inspect.Parameter(
    "config", inspect.Parameter.KEYWORD_ONLY, default=None,
    annotation=Annotated[Optional[Path], typer.Option("--config", help="TOML file with options (flag names as keys)",
                                                      rich_help_panel=OPS, envvar=env_var("config"), show_envvar=True)])
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
    log_format: Annotated[str, typer.Option("--log-format", help="text | json", rich_help_panel=OPS, envvar=env_var("log_format"), show_envvar=True)] = "text",
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
    if not node.net.compute.wait_idle(0):
        _exit_now(code)  # interpreter teardown under a running torch kernel would abort the process
    raise typer.Exit(code)


def _exit_now(code: int) -> None:
    """Exit with ``code`` at once, skipping interpreter teardown (everything the node owns is already closed)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
    chaos: Annotated[Optional[list[str]], typer.Option("--chaos", help="Fault injection (repeatable): kill:stage=S:at=60s, kill:node=I:at=T, kill:random:every=45s (SIGKILL); pause:node=I:every=T:for=S (SIGSTOP for S seconds)")] = None,
    restart_killed: Annotated[Optional[float], typer.Option("--restart-killed", help="Restart killed nodes after this many seconds (default: leave them dead)")] = None,
    byzantine: Annotated[Optional[list[str]], typer.Option("--byzantine", help="Experiments: node I attacks the swarm, as I:ATTACK[,ATTACK] (repeatable), e.g. '1:scale:50' or '2:alie'; attacks: samples, scale:K, sign, noise, alie, ipm, stale, concentrate, cap, future; activations:K for a pipeline trainer")] = None,
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


# the read-only commands (node/cli/inspection.py), in the order `node --help` lists them
app.command()(inspection.status)
app.command("probe")(inspection.probe_cmd)
app.command("eval")(inspection.eval_cmd)
app.command("export")(inspection.export_cmd)
app.command()(inspection.doctor)

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
