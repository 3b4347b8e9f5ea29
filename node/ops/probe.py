"""``node probe MADDR``: ask one node what it is doing, over py-libp2p (the ``lite`` extra).

No DHT, no hivemind, no torch, no p2pd: a py-libp2p host dials the node's multiaddr, opens
``/locomesh/status/1.0`` (with the swarm-key hello when one is given) and returns the node's status.
Every failure becomes a :class:`ProbeError` whose message says what happened and what to do.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from node.runtime.status_service import fetch_status
from protocol import ids
from protocol.errors import AuthError, ProtocolError, RemoteError, StreamTimeout

LITE_HINT = "the probe needs the light client: pip install 'locomesh[lite]'"


class ProbeError(Exception):
    """A probe that failed; ``str()`` is the one-line explanation, ``exit_code`` what the CLI returns."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _explain_remote(e: RemoteError, peer: str, key: str | None) -> ProbeError:
    if e.remote_code == "auth":
        if key is None:
            return ProbeError(f"{peer} is in a private swarm and refused us: pass its key with --swarm-key-file PATH")
        return ProbeError(f"{peer} refused {key}: it is not this swarm's key")
    if key is not None and e.remote_code == "schema" and "not in a private swarm" in str(e):
        return ProbeError(f"{peer} is not in a private swarm: probe it without --swarm-key-file")
    return ProbeError(f"{peer} refused the status request: {e}")


async def _bounded(fn: Any, timeout: float) -> Any:
    import trio

    with trio.fail_after(timeout):
        return await fn()


def probe(maddr: str, swarm_key: bytes | None = None, timeout: float = 10.0, key_file: Path | None = None) -> dict[str, Any]:
    """Dial ``maddr`` (``/ip4/HOST/tcp/PORT/p2p/PEER_ID``) and return the node's status, plus a ``probe``
    entry with the address and timings. ``key_file`` only names the key in messages. Raises :class:`ProbeError`."""
    key = None if swarm_key is None else f"the key in {key_file}" if key_file else "the given swarm key"
    try:
        import trio

        from protocol.libp2p_transport import DialError, open_client
    except ImportError as e:
        raise ProbeError(f"{LITE_HINT} ({e})", exit_code=2) from None

    async def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        async with open_client(swarm_key) as client:
            t1 = time.perf_counter()
            peer = await client.connect(maddr)
            t2 = time.perf_counter()
            try:
                status = await fetch_status(client, peer)
            except RemoteError as e:
                raise _explain_remote(e, peer, key) from None
            except AuthError:
                raise ProbeError(f"{peer} did not prove it holds {key}: it is not this swarm's node "
                                 "or not this swarm's key") from None
            except StreamTimeout as e:
                raise ProbeError(f"{peer} stalled: {e}") from None
            except ProtocolError as e:
                raise ProbeError(f"{peer} sent an invalid status reply ({e}): is it a locomesh node of a compatible version?") from None
            except (ConnectionError, EOFError) as e:
                raise ProbeError(f"connected to {peer} but it did not answer on {ids.STATUS} ({e}): "
                                 "is it a locomesh node of a compatible version?") from None
            t3 = time.perf_counter()
        status = dict(status)
        status["probe"] = {"address": maddr, "start_s": round(t1 - t0, 4), "connect_s": round(t2 - t1, 4),
                           "request_s": round(t3 - t2, 4)}
        return status

    try:
        return trio.run(_bounded, run, timeout)
    except DialError as e:
        if e.reason == "bad_address":
            raise ProbeError(f"{e}; use an address a node prints (its --info-file 'multiaddrs')", exit_code=2) from None
        if e.reason == "unreachable":
            raise ProbeError(f"{e}: is the node running, and is its port open to you? (`node doctor` on its host checks)") from None
        if e.reason == "wrong_peer":
            raise ProbeError(f"{e}: the address now belongs to another node; use the multiaddr it prints") from None
        raise ProbeError(f"{e}: is this a locomesh node's libp2p port?") from None
    except trio.TooSlowError:
        raise ProbeError(f"no answer from {maddr} within {timeout:g}s: a firewall may drop the packets or the node is "
                         "overloaded; check the address or retry with a larger --timeout") from None


def render_probe(status: dict[str, Any]) -> None:
    """The probed node's status as a two-column table."""
    from rich.console import Console
    from rich.table import Table

    def num(key: str, fmt: str) -> str:
        value = status.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"

    probe_info = status.get("probe", {})
    table = Table(title=f"node {status.get('peer_id', '?')}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    rows = [
        ("run", str(status.get("run_id", "?"))), ("state", str(status.get("state", "?"))),
        ("outer round", num("round", "d")), ("step in round", num("inner_step", "d")), ("steps", num("steps", "d")),
        ("loss", num("loss", ".4f")), ("tokens/s", num("tokens_per_s", ".0f")), ("device", str(status.get("device", "?"))),
        ("model", str(status.get("model", "?"))), ("algorithm", str(status.get("algorithm", "?"))),
        ("compression", str(status.get("compression", "?"))), ("version", str(status.get("version", "?"))),
        ("protocols", " ".join(map(str, status.get("protocols", [])))),
        ("connect", f"{probe_info.get('connect_s', 0) * 1000:.0f} ms, request {probe_info.get('request_s', 0) * 1000:.0f} ms"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
