"""``node service install | remove``: run ``node join`` for months as a systemd user service.

``install`` validates the join options exactly as ``node join`` does (a bad option is refused now, not at
the first start), gives the node a --checkpoint-dir when it has none (``~/.local/share/locomesh/<run-id>``,
so a restart resumes), and writes ``~/.config/systemd/user/locomesh-<run-id>.service``: this venv's
``node join`` with those options, restarted on failure, stopped by SIGTERM to the node alone (it then
leaves cleanly and writes its final checkpoint before p2pd goes) with time for that, logging to the journal.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from node.cli import command_group
from node.config import NodeConfig, load_config, read_swarm_key
from node.errors import UserError

service_app = command_group("service", "Run `node join` as a systemd user service: install | remove.")
STOP_TIMEOUT_S = 300  # the step in progress, the last heartbeat (10 s), the final evaluation and checkpoint, p2pd's shutdown (20 s)


def unit_dir(given: Optional[Path]) -> Path:
    """Where user units live: ``--unit-dir``, else ``$XDG_CONFIG_HOME/systemd/user`` (``~/.config/systemd/user``)."""
    if given is not None:
        return given
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user"


def default_checkpoint_dir(run_id: str) -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "locomesh" / run_id


def _quote(arg: str) -> str:
    """One ExecStart argument: specifiers (%) and variables ($) escaped, quoted when it holds a space or quote."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def node_command() -> list[str]:
    """This venv's ``node`` console script by absolute path (or its python ``-m node``)."""
    script = Path(sys.executable).parent / "node"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script.absolute())]
    return [str(Path(sys.executable).absolute()), "-m", "node"]


def unit_text(run_id: str, args: list[str], workdir: Path, env: dict[str, str]) -> str:
    """The unit file of ``node join <args>``."""
    exec_start = " ".join(_quote(a) for a in [*node_command(), "join", *args])
    environment = "".join(f"Environment={_quote(f'{k}={v}')}\n" for k, v in sorted(env.items()))
    return f"""[Unit]
Description=locomesh node of run {run_id}

[Service]
Type=simple
# relative paths among the options are relative to the folder it was installed from
WorkingDirectory={str(workdir).replace("%", "%%")}
ExecStart={exec_start}
Environment=PYTHONUNBUFFERED=1
{environment}Restart=on-failure
RestartSec=30
# SIGTERM to the node alone: it leaves the swarm and writes its final checkpoint while p2pd still runs
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec={STOP_TIMEOUT_S}
StandardOutput=journal
StandardError=journal
SyslogIdentifier=locomesh-{run_id}

[Install]
WantedBy=default.target
"""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _join_config(ctx: typer.Context, args: list[str]) -> NodeConfig:
    """``args`` read by ``node join``'s own parser and config, as ``node join`` reads them (ConfigError: one line)."""
    join = ctx.find_root().command.commands["join"]  # type: ignore[attr-defined]
    try:
        params = dict(join.make_context("join", list(args), resilient_parsing=False).params)
    except Exception as e:  # click's UsageError (typer vendors click, so match by its API)
        if not hasattr(e, "format_message"):
            raise
        raise UserError(f"{e.format_message()} (see `node join --help`)") from None
    config = params.pop("config", None)
    for own in ("log_format", "dry_run"):
        params.pop(own, None)
    cfg = load_config(params, config)
    if cfg.swarm_key is not None:
        read_swarm_key(cfg.swarm_key)
    return cfg


@service_app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                       "help_option_names": ["-h", "--help"]})
def install(
    ctx: typer.Context,
    name: Annotated[Optional[str], typer.Option(help="Unit name (default: locomesh-<run-id>)")] = None,
    unit_dir_opt: Annotated[Optional[Path], typer.Option("--unit-dir", help="Folder of the unit file (default: ~/.config/systemd/user)")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing unit of that name")] = False,
) -> None:
    """Write a systemd user unit that runs `node join` with the given join options (checked now).

    Example: node service install --run-id myrun --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo... --active-hours 22-07
    """
    from node.cli.preflight import check_data

    args = list(ctx.args)
    cfg = _join_config(ctx, args)
    check_data(cfg.data)
    if cfg.checkpoint_dir is None:
        args += ["--checkpoint-dir", str(default_checkpoint_dir(cfg.run_id))]
    unit = name or f"locomesh-{cfg.run_id}"
    if not all(c.isalnum() or c in "-_.@:" for c in unit):
        raise UserError(f"--name {unit!r}: use letters, digits and - _ . @ : only (it names the unit file)")
    folder = unit_dir(unit_dir_opt)
    path = folder / f"{unit}.service"
    if path.exists() and not force:
        raise UserError(f"{path} exists: remove it first (node service remove --name {unit}) or pass --force to replace it")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k.startswith("LOCOMESH_") and k not in ("LOCOMESH_SUPERVISED",)}
        _write_atomic(path, unit_text(cfg.run_id, args, Path.cwd(), env))
    except OSError as e:
        raise UserError(f"cannot write {path} ({e.strerror or e}); pass --unit-dir a folder you can write to") from None
    print(f"wrote {path}\n"
          f"it runs: node join {shlex.join(args)}\n"
          f"start it now and at every login:\n  systemctl --user daemon-reload && systemctl --user enable --now {unit}.service\n"
          f"keep it running after you log out (and from boot):\n  loginctl enable-linger $USER\n"
          f"its log:\n  journalctl --user -u {unit} -f")


@service_app.command()
def remove(
    name: Annotated[Optional[str], typer.Option(help="Unit name (default: locomesh-<run-id>)")] = None,
    run_id: Annotated[str, typer.Option(help="Run of the unit, when --name is not given")] = "locomesh-demo",
    unit_dir_opt: Annotated[Optional[Path], typer.Option("--unit-dir", help="Folder of the unit file (default: ~/.config/systemd/user)")] = None,
) -> None:
    """Delete a unit written by `node service install`, and its enablement; prints how to stop it if it runs."""
    unit = name or f"locomesh-{run_id}"
    folder = unit_dir(unit_dir_opt)
    path = folder / f"{unit}.service"
    if not path.is_file():
        raise UserError(f"no unit {path}; give the --name (or --run-id) it was installed with, and --unit-dir if one was given")
    path.unlink()
    enabled = folder / "default.target.wants" / f"{unit}.service"
    if enabled.is_symlink():
        enabled.unlink()  # what `systemctl --user enable` made, which disable can no longer find without the file
    print(f"removed {path}\nif it runs, stop it (the node leaves cleanly) and forget it:\n"
          f"  systemctl --user stop {unit}.service; systemctl --user daemon-reload")
