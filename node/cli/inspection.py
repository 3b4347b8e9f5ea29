"""The ``node`` commands that read a run, a node or a checkpoint and change nothing: ``status``, ``probe``,
``eval``, ``export`` and ``doctor``. Plain functions with typer's annotations; ``node.cli.app``
registers them on the ``node`` group.
"""

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from node.cli import env_var
from node.config import ConfigError
from node.errors import UserError


def status(
    initial_peers: Annotated[list[str], typer.Option("--initial-peers", help="Multiaddr of any peer of the run (repeatable)", envvar=env_var("initial_peers"))],
    run_id: Annotated[str, typer.Option(help="Run to list", envvar=env_var("run_id"))] = "locomesh-demo",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table (with --watch: one line per refresh)")] = False,
    swarm_key: Annotated[Optional[Path], typer.Option(help="Secret file of a private swarm", envvar=env_var("swarm_key"))] = None,
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


def probe_cmd(
    maddr: Annotated[str, typer.Argument(metavar="MADDR", help="The node's multiaddr with its peer id: /ip4/HOST/tcp/PORT/p2p/PEER_ID", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")] = False,
    swarm_key_file: Annotated[Optional[Path], typer.Option("--swarm-key-file", help="Secret file of the node's private swarm", envvar=env_var("swarm_key"))] = None,
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


def export_cmd(
    out: Annotated[Path, typer.Option(help="Folder to create (must not exist, or be empty)")],
    checkpoint: Annotated[Optional[Path], typer.Option(help="Checkpoint of a --model llama-* run (checkpoint.pt, or its --checkpoint-dir)")] = None,
    weights: Annotated[str, typer.Option(help="phi (the swarm's agreed weights) or theta (the node's last local weights)")] = "phi",
    initial_peers: Annotated[Optional[list[str]], typer.Option("--initial-peers", metavar="<maddr>", help="Instead of --checkpoint: export a live pipeline run (--stages > 1), asking a server of each stage for its weights; the multiaddr of any of its peers (repeatable)")] = None,
    run_id: Annotated[str, typer.Option(help="With --initial-peers: the pipeline's run")] = "locomesh-demo",
    data: Annotated[Optional[Path], typer.Option(help="With --initial-peers: the token shard folder the run trains on (its tokenizer.json goes into the export)")] = None,
    swarm_key_file: Annotated[Optional[Path], typer.Option("--swarm-key-file", help="Secret file of the run's private swarm", envvar=env_var("swarm_key"))] = None,
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
