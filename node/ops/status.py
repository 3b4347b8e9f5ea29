"""``node status``: join the DHT as a client, list the run's peers and ask each for its live status.
Each peer's locomesh and protocol versions are shown; one of another protocol is flagged outdated or newer."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any, Callable

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time

from gossip.rendezvous import list_peers_with_expiry, watch_records
from node.runtime.network import learn_routes
from node.runtime.status_service import fetch_status
from swarm.stage_map import missing_roles
from protocol.hivemind_transport import Transport
from protocol.peer_identity import OwnedRecordValidator, identified_p2p
from protocol.version import UPGRADE, package_version, protocol_version


class StatusClient:
    """A DHT client of the run that can list its peers repeatedly (``node status --watch`` keeps one open)."""

    def __init__(self, *, initial_peers: list[str], run_id: str, timeout: float = 5.0, swarm_key: bytes | None = None) -> None:
        self.initial_peers, self.run_id, self.timeout, self.swarm_key = initial_peers, run_id, timeout, swarm_key
        self.p2p: P2P | None = None
        self.dht: DHTNode | None = None

    async def __aenter__(self) -> "StatusClient":
        self.p2p, signer = await identified_p2p(initial_peers=self.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            self.dht = await DHTNode.create(p2p=self.p2p, initial_peers=self.initial_peers, client_mode=True,
                                            record_validator=OwnedRecordValidator(signer.identity, swarm_key=self.swarm_key))
        except BaseException:
            await self.p2p.shutdown()
            raise
        # peers behind NAT are asked through their relays, and a relayed stream proves this identity
        self.transport = Transport(self.p2p, swarm_key=self.swarm_key, identity=signer.identity)
        watch_records(self.dht, lambda records: learn_routes(self.transport, records))  # peers behind NAT: via their relays
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.dht is not None:
            await self.dht.shutdown()
        if self.p2p is not None:
            await self.p2p.shutdown()

    async def collect(self) -> dict[str, Any]:
        """The run's peers from the DHT, each also asked for its live status."""
        from node.runtime.base import RECORD_TTL_S

        assert self.dht is not None
        records = await asyncio.wait_for(list_peers_with_expiry(self.dht, self.run_id, compatible_only=False), timeout=30)
        now = get_dht_time()

        async def one(peer: str) -> dict[str, Any] | None:
            try:
                return await asyncio.wait_for(fetch_status(self.transport, peer), self.timeout)
            except Exception:
                return None

        live = await asyncio.gather(*(one(p) for p in records))
        rows = []
        for (peer, (rec, expiration)), st in zip(records.items(), live):
            rows.append({
                "peer_id": peer, "role": rec.role, "device": rec.device, "model": rec.model, "algorithm": rec.algorithm,
                "compression": rec.compression, "tokens_per_s": rec.tokens_per_s, "round": rec.round,
                "inner_step": rec.inner_step, "loss": rec.loss, "record_age_s": max(0.0, RECORD_TTL_S - (expiration - now)),
                "maddrs": rec.maddrs, "protocols": rec.protocols, "reachable": st is not None, "live": st,
                "stage": rec.stage, "queue": rec.queue, "reachability": rec.reachability,
                "version": rec.version, "protocol": rec.protocol, "compatibility": compatibility(rec.protocol),
            })
        _add_scores(rows, [st for st in live if isinstance(st, dict)])
        stages = max((st.get("stages", 0) for st in live if isinstance(st, dict) and isinstance(st.get("stages"), int)), default=0)
        result = {"run_id": self.run_id, "time": time.time(), "peers": sorted(rows, key=lambda r: r["peer_id"]),
                  "stages": stage_map(rows, stages)}
        if stages > 1:
            result["missing"] = missing_roles([rec for rec, _ in records.values()], stages)
        if not rows:
            result["hint"] = await self._other_runs_hint()
        odd = [r for r in rows if r["compatibility"] != "ok"]
        if odd:
            result["version_hint"] = (f"{len(odd)} peer(s) run another protocol version than this client's {protocol_version()} "
                                      f"(locomesh {package_version()}) and train apart: upgrade the outdated side with "
                                      f"`{UPGRADE}`")
        return result

    async def _other_runs_hint(self) -> str:
        """Why no peer of the run showed up: ask each initial peer which run it serves."""
        runs: dict[str, str] = {}
        for maddr in self.initial_peers:
            peer = maddr.rsplit("/p2p/", 1)[1] if "/p2p/" in maddr else None
            if peer is None:
                continue
            try:
                status = await asyncio.wait_for(fetch_status(self.transport, peer), self.timeout)
            except Exception:
                continue
            if isinstance(status.get("run_id"), str):
                runs[maddr] = status["run_id"]
        others = {maddr: run for maddr, run in runs.items() if run != self.run_id}
        if others:
            maddr, run = next(iter(others.items()))
            return f"no peers of run {self.run_id}; {maddr} is in run {run}: add --run-id {run}"
        if runs:
            return f"no peers of run {self.run_id} are announced yet; {next(iter(runs))} serves it: retry in a few seconds"
        return f"no peers of run {self.run_id}, and no initial peer answered: check the multiaddr and that the node runs"


def _add_scores(rows: list[dict[str, Any]], live: list[dict[str, Any]]) -> None:
    """Each peer's contribution score (``gossip.scores``): the median of what the other peers' live
    statuses report for it (a peer's word about others; the median bounds one liar), None where nobody
    scored it (private swarms, pipelines, zo, or no round with others yet)."""
    for row in rows:
        views = [st.get("peer_scores") for st in live if st.get("peer_id") != row["peer_id"]]
        scores = [v[row["peer_id"]].get("score") for v in views if isinstance(v, dict) and isinstance(v.get(row["peer_id"]), dict)]
        finite = [float(x) for x in scores if isinstance(x, (int, float)) and math.isfinite(x)]
        row["score"] = statistics.median(finite) if finite else None


def compatibility(protocol: int) -> str:
    """How a peer of ``protocol`` stands against this client: ok, outdated (older protocol) or newer."""
    ours = protocol_version()
    return "ok" if protocol == ours else "outdated" if protocol < ours else "newer"


def stage_map(rows: list[dict[str, Any]], stages: int = 0) -> list[dict[str, Any]]:
    """Pipeline runs: per stage its servers, summed throughput and queued requests (empty otherwise);
    ``stages`` (from the peers' live status) makes unserved last stages show too."""
    servers = [r for r in rows if r["role"] == "stage" and r.get("stage", -1) >= 0]
    if not servers and stages <= 1:
        return []
    out = []
    for stage in range(max([stages] + [r["stage"] + 1 for r in servers])):
        members = [r for r in servers if r["stage"] == stage]
        out.append({"stage": stage, "peers": [r["peer_id"] for r in members], "tokens_per_s": sum(r["tokens_per_s"] for r in members),
                    "queue": sum(r["queue"] for r in members)})
    return out


async def _collect(initial_peers: list[str], run_id: str, timeout: float, swarm_key: bytes | None) -> dict[str, Any]:
    async with StatusClient(initial_peers=initial_peers, run_id=run_id, timeout=timeout, swarm_key=swarm_key) as client:
        return await client.collect()


def collect_status(initial_peers: list[str], run_id: str, timeout: float = 5.0, swarm_key: bytes | None = None) -> dict[str, Any]:
    return asyncio.run(_collect(initial_peers, run_id, timeout, swarm_key))


async def _watch(initial_peers: list[str], run_id: str, interval: float, count: int, timeout: float,
                 swarm_key: bytes | None, show: Callable[[dict[str, Any]], None]) -> None:
    async with StatusClient(initial_peers=initial_peers, run_id=run_id, timeout=timeout, swarm_key=swarm_key) as client:
        done = 0
        while True:
            started = time.monotonic()
            show(await client.collect())
            done += 1
            if count and done >= count:
                return
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))


def watch_status(initial_peers: list[str], run_id: str, show: Callable[[dict[str, Any]], None], interval: float = 5.0,
                 count: int = 0, timeout: float = 5.0, swarm_key: bytes | None = None) -> None:
    """Call ``show(result)`` every ``interval`` seconds, ``count`` times (0 = until interrupted), over one DHT client."""
    asyncio.run(_watch(initial_peers, run_id, interval, count, timeout, swarm_key, show))


def status_table(result: dict[str, Any]) -> Any:
    """The rich renderable of a status result: the peers' table, and a hint when there are none."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def line(text: str) -> Text:  # one line, never wrapped: hints hold multiaddrs and flags to copy
        return Text(text, no_wrap=True, overflow="ignore")

    table = Table(title=f"run {result['run_id']}: {len(result['peers'])} peers")
    for col in ("peer", "role", "device", "reach", "version", "tok/s", "round", "step", "loss", "score", "age"):
        table.add_column(col, justify="right" if col not in ("peer", "role", "device", "reach", "version") else "left")
    for r in result["peers"]:
        role = r["role"] + (f" {r['stage']}" if r.get("stage", -1) >= 0 else "")
        version = f"{r.get('version') or '?'} p{r.get('protocol', 1)}"
        if r.get("compatibility", "ok") != "ok":
            version += f" [red]{r['compatibility']}[/red]"
        table.add_row(r["peer_id"][-12:], role, r["device"], r.get("reachability", "unknown"), version, f"{r['tokens_per_s']:.0f}",
                      str(r["round"]), str(r["inner_step"]), f"{r['loss']:.3f}",
                      "–" if r.get("score") is None else f"{r['score']:+.2f}", f"{r['record_age_s']:.1f}s")
    if not result["peers"]:
        return Group(table, line(result.get("hint") or "No live peers: check --run-id and that the multiaddr is of a running node."))
    if result.get("version_hint"):
        table = Group(table, line(result["version_hint"]))
    if result.get("stages"):
        stages = Table(title="pipeline stages")
        for col in ("stage", "servers", "tok/s", "queued"):
            stages.add_column(col, justify="right")
        for st in result["stages"]:
            stages.add_row(str(st["stage"]), str(len(st["peers"])) + ("  (none: lost!)" if not st["peers"] else ""),
                           f"{st['tokens_per_s']:.0f}", str(st["queue"]))
        if result.get("missing"):
            return Group(table, stages, f"pipeline short of nodes: it needs {' and '.join(result['missing'])}; "
                                        "the next node that joins takes that role")
        return Group(table, stages)
    return table


def render_status(result: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(status_table(result), crop=False)  # hint lines stay whole (see status_table)
