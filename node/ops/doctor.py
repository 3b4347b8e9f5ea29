"""``node doctor``: check that this machine can run a node, and say how to fix what cannot.

Checks: Python, torch (and its CUDA), hivemind and numpy versions against what the project is tested with; that p2pd starts; that the listen port is free
and reachable on loopback; the training device and memory; free disk for checkpoints; and, given
``--initial-peers``, that a peer answers, how far its clock is from ours, and whether peers can dial
this machine (a peer dials it back: :mod:`node.runtime.reachability`) with what to do about it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MIN_FREE_DISK_GB = 1.0
# What the project is tested with (pyproject.toml says the same): make test runs on each of these Pythons;
# torch from 2.11 (the oldest run: the unit suite and 2-replica swarms on a CUDA machine) to 2.13 (pinned).
PYTHONS = ((3, 11), (3, 12), (3, 13))
TORCH_OLDEST, TORCH_NEWEST = (2, 11), (2, 13)
MAX_CLOCK_SKEW_S = 5.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def torch_supported(version: str) -> bool:
    """Whether a ``torch.__version__`` (``2.13.0+cpu``, ``2.11.0a0+git…``) lies in the tested range."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return TORCH_OLDEST <= (major, minor) <= TORCH_NEWEST


def _versions() -> list[Check]:
    pythons = " or ".join(f"{major}.{minor}" for major, minor in PYTHONS)
    out = [Check("python", sys.version_info[:2] in PYTHONS, sys.version.split()[0],
                 f"install Python {pythons} and rerun `make setup PYTHON=python{pythons.split(' or ')[-1]}`")]
    try:
        import torch

        cuda = f", CUDA {torch.version.cuda}" if getattr(torch.version, "cuda", None) else ", CPU build"
        out.append(Check("torch", torch_supported(torch.__version__), torch.__version__ + cuda,
                         f"use torch {'.'.join(map(str, TORCH_OLDEST))} to {'.'.join(map(str, TORCH_NEWEST))}: "
                         "pip install -c constraints.txt torch"))
    except ImportError as e:
        out.append(Check("torch", False, str(e), "run `make setup` (or pip install -c constraints.txt -e .)"))
    try:
        import hivemind

        out.append(Check("hivemind", hivemind.__version__ == "1.1.12", hivemind.__version__, "pip install -c constraints.txt hivemind==1.1.12"))
    except ImportError as e:
        out.append(Check("hivemind", False, str(e), "run `make setup`"))
    import numpy

    major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
    out.append(Check("numpy", (major, minor) < (2, 4), numpy.__version__,
                     "numpy >= 2.4 silently breaks hivemind's 8-bit codecs: pip install 'numpy<2.4'"))
    return out


def _p2pd() -> Check:
    from hivemind.p2p import P2P

    async def go() -> float:
        t0 = time.perf_counter()
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        elapsed = time.perf_counter() - t0
        await p2p.shutdown()
        return elapsed

    try:
        return Check("p2pd", True, f"started and stopped in {asyncio.run(go()):.2f}s")
    except Exception as e:
        return Check("p2pd", False, f"{type(e).__name__}: {e}", "reinstall hivemind (its wheel bundles p2pd for linux x86-64)")


def _port(port: int) -> Check:
    if port == 0:
        return Check("listen port", True, "port 0: the OS picks a free port", "")
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))
            s.listen(1)
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
        return Check("listen port", True, f"{port} is free and reachable on loopback")
    except OSError as e:
        return Check("listen port", False, f"{port}: {e.strerror}",
                     f"another program uses port {port} (see `ss -ltnp | grep {port}`): stop it or pass --listen /ip4/0.0.0.0/tcp/<other port>")


def _device(requested: str) -> Check:
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        free, total = torch.cuda.mem_get_info()
        return Check("device", True, f"cuda: {name}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    if requested == "cuda":
        return Check("device", False, "--device cuda but torch sees no CUDA device", "install a CUDA build of torch, or use --device auto")
    mps = getattr(torch.backends, "mps", None)
    extra = " (MPS present, locomesh trains on CPU there)" if mps is not None and mps.is_available() else ""
    return Check("device", True, f"cpu: {os.cpu_count()} cores, torch uses {torch.get_num_threads()} threads{extra}")


def _memory() -> Check:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        avail = int(info["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return Check("memory", True, "unknown (no /proc/meminfo)")
    return Check("memory", avail >= 1.0, f"{avail:.1f} GiB available", "free memory or use a smaller --model")


def _disk(directory: Path) -> Check:
    target = directory
    while not target.exists() and target != target.parent:
        target = target.parent
    free = shutil.disk_usage(target).free / 2**30
    return Check("disk", free >= MIN_FREE_DISK_GB, f"{free:.1f} GiB free under {directory}",
                 f"free at least {MIN_FREE_DISK_GB} GiB or point --checkpoint-dir elsewhere")


def _peers(initial_peers: list[str], run_id: str) -> Check:
    from node.ops.status import collect_status

    try:
        t0 = time.time()
        result = collect_status(initial_peers, run_id)
        t1 = time.time()
    except Exception as e:
        return Check("peers", False, f"cannot reach {initial_peers[0]}: {e}", "check the multiaddr, the run id and your firewall")
    live = [p["live"] for p in result["peers"] if p.get("live")]
    if not live:
        return Check("peers", False, f"no reachable peer of run {run_id!r}", "check --run-id; the peer may be behind NAT (ask it for --announce)")
    skews = [p["time"] - (t0 + t1) / 2 for p in live if isinstance(p.get("time"), (int, float))]
    worst = max(skews, key=abs) if skews else 0.0
    return Check("clock skew", abs(worst) <= MAX_CLOCK_SKEW_S, f"{len(live)} peers answered; largest skew {worst:+.2f}s",
                 "DHT records expire by wall clock: enable NTP (timedatectl set-ntp true)")


def _reachability(port: int, initial_peers: list[str]) -> Check:
    from protocol.hivemind_transport import Transport

    from node.runtime import reachability as reach
    from node.runtime.network import peer_id_of

    async def go() -> reach.Reachability:
        p2p = await reach.create_p2p("public", initial_peers, relay_service=False, host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"])
        try:
            transport = Transport(p2p)
            own = [str(a) for a in await p2p.get_visible_maddrs()]
            return await reach.detect(transport, [peer_id_of(p) for p in initial_peers], reach.tcp_ports(own))
        finally:
            await p2p.shutdown()

    try:
        found = asyncio.run(go())
    except Exception as e:
        return Check("reachability", False, f"could not ask for a dial-back: {type(e).__name__}: {e}",
                     "check --initial-peers (a peer must run this locomesh version or newer)")
    if found.state == "public":
        return Check("reachability", True, f"public: peers dialled you back at {', '.join(found.dialable)}. "
                     f"Nothing to do{'' if port else '; pass a fixed --listen port if a firewall opens only one'}")
    if found.state == "private":
        forward = (f"forward TCP port {port}" if port else "pick a port P, forward TCP port P") + \
            f" on your router to this machine{'' if port else ' and join with --listen /ip4/0.0.0.0/tcp/P'}"
        return Check("reachability", True, f"private (behind NAT or a firewall; seen as {found.observed or '?'}): you will "
                     f"train through relays on public peers, which carry all your traffic (each byte crosses the relay's "
                     f"link twice). For direct connections, {forward}")
    return Check("reachability", False, found.detail, "check --initial-peers: the peer must run this locomesh version or newer")


def run_checks(port: int, device: str, checkpoint_dir: Path, initial_peers: list[str], run_id: str) -> list[Check]:
    steps: list[Callable[[], Check | list[Check]]] = [
        _versions, _p2pd, lambda: _port(port), lambda: _device(device), _memory, lambda: _disk(checkpoint_dir),
    ]
    if initial_peers:
        steps.append(lambda: _peers(initial_peers, run_id))
        steps.append(lambda: _reachability(port, initial_peers))
    checks: list[Check] = []
    for step in steps:
        got = step()
        checks.extend(got if isinstance(got, list) else [got])
    return checks


def render(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="locomesh doctor")
    for col in ("check", "result", "detail", "how to fix"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.name, "[green]pass[/]" if c.ok else "[red]FAIL[/]", c.detail, "" if c.ok else c.fix)
    Console().print(table)
