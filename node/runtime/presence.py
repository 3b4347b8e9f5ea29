"""A node's presence on the network, shared by every kind of node (mixed into ``node.runtime.base.NodeBase``):
starting p2pd and the DHT, the heartbeat that publishes the node's DHT record and reads the run's records,
which members count as live (they answer a status probe), the node's own addresses and the join hint it
prints for volunteers on other machines.

It uses the node's attributes that :class:`~node.runtime.base.NodeBase` sets up (``cfg``, ``net``,
``summary``, ``metrics``, ``stop``, ...) and its hooks (``_record_fields``, ``_record_runs``,
``_observe_peers``, ``_join_hint``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from gossip.byzantine import announced_up_mbit
from gossip.dht_io import in_background, waited
from gossip.reachable import Reachable
from gossip.rendezvous import list_peers, publish_peer_here, reconnect_routing_table, spread_peer
from node.config import read_swarm_key
from node.errors import UserError
from node.runtime.reachability import dialable_addresses
from node.runtime.status_service import fetch_status
from protocol.datachannel import listen_host
from protocol.ratelimit import RateLimits
from protocol.records import PEER_RECORD_TTL_S, PeerRecord
from protocol.version import package_version, protocol_version

logger = logging.getLogger("locomesh.node")

# the longest a round waits for the heartbeat before its rendezvous: a DHT store waits seconds for a peer
# that stopped answering (8–10 s measured, for a frozen process whose p2pd still accepts streams)
ROUND_ANNOUNCE_WAIT_S = 1.0
# the longest a heartbeat waits for its record's copies on the key's nearest nodes (the same stores)
SPREAD_WAIT_S = 1.0


class NetworkPresence:
    """Networking start-up, heartbeat, live members, addresses and join hint of a node."""

    cfg: Any
    net: Any
    summary: Any
    metrics: Any
    PEER_READ_EVERY = 1  # heartbeats between two reads of the run's records
    _announcing: "asyncio.Future[None] | None" = None  # the heartbeat a round last started (it may run on)
    _spreading: "asyncio.Future[None] | None" = None  # the record's stores on other nodes a heartbeat last started

    def reachable_members(self) -> Reachable:
        """Filters the members a rendezvous waits for to those that answer a status request: a signed
        record proves a key, not a running peer (gossip.reachable.Reachable)."""

        async def probe(peer: str) -> None:
            await fetch_status(self.net.transport, peer)

        return Reachable(probe)

    async def _announce_for_round(self) -> None:
        """The heartbeat before a round's rendezvous (the record then names the round), waited for at most
        ``ROUND_ANNOUNCE_WAIT_S``; it goes on in the background. Awaited whole, a slow DHT store held this member
        out of the rendezvous past its deadline, and every other member with it (live: 12–16 s against a 5 s
        deadline while one member was frozen)."""
        if self._announcing is None or self._announcing.done():  # (one still running from the last round is waited for)
            self._announcing = in_background(self._heartbeat(), "heartbeat")
        if not await waited(self._announcing, ROUND_ANNOUNCE_WAIT_S):
            logger.info("the heartbeat before round %d is slow (a peer does not answer the DHT): not waiting for it", self.round)

    async def _heartbeat(self, whole: bool = False) -> None:
        """Publish this node's DHT record; every PEER_READ_EVERY heartbeats, read the run's records too.

        The record goes into this node's own storage at once (every read asks this node too). Its copies on the
        key's nearest nodes, after reconnecting the routing table, are stored in the background and waited for at
        most ``SPREAD_WAIT_S``; the next copies start once those ended. A frozen peer (its p2pd still takes streams)
        held each ping 3 s and each store 7–10 s: a heartbeat that awaited them came every 10–13 s, past the
        record's 8 s life, and the members' own records expired, so a rendezvous saw nobody to wait for.
        ``whole``: this record's copies are stored before it returns (a role's change, leaving the run)."""
        await self._refresh_addresses()
        net, cfg, s = self.net, self.cfg, self.summary
        record = PeerRecord(**{
            "peer_id": s.peer_id, "role": self.role, "device": self.device.type, "model": cfg.model, "algorithm": self.algorithm,
            "compression": cfg.codec, "round": self.round, "loss": self._current_loss(), "maddrs": s.multiaddrs,
            "protocols": s.protocols, "version": package_version(), "protocol": protocol_version(),
            "reachability": s.reachability, "up_mbit": announced_up_mbit(cfg.attack, cfg.max_upload_mbit or 0.0),
            "started_at": time.time() - (time.monotonic() - self.started), **self._record_fields()})
        runs = self._record_runs()
        for run_id in runs:
            publish_peer_here(net.dht, net.validator, run_id, record, PEER_RECORD_TTL_S)
        if whole:
            await self._spread_record(record, runs)
        else:
            if self._spreading is None or self._spreading.done():
                self._spreading = in_background(self._spread_record(record, runs), "storing this node's record on other nodes")
            await waited(self._spreading, SPREAD_WAIT_S)
        # reading the members' records costs a request per routing-table peer: kinds that need them
        # seldom read them only every few heartbeats
        self.heartbeats += 1
        if (self.heartbeats - 1) % self.PEER_READ_EVERY == 0:
            peers = await list_peers(net.dht, cfg.run_id)
            self.metrics.peers.set(len(peers))
            self._observe_peers(peers)

    async def _spread_record(self, record: PeerRecord, runs: list[str]) -> None:
        """The record's copies on the key's nearest nodes (hivemind's store), once the routing table is reconnected."""
        net = self.net
        await reconnect_routing_table(net.dht, [info.peer_id for info in await net.p2p.list_peers()])
        for run_id in runs:
            await spread_peer(net.dht, net.validator, run_id, record, PEER_RECORD_TTL_S)

    def _start_network(self) -> bool:
        """Start p2pd and the DHT; False (after logging why) when it cannot."""
        cfg = self.cfg
        try:
            self.net.start(
                cfg.initial_peers, cfg.listen, cfg.announce, str(cfg.identity) if cfg.identity else None,
                on_bytes=self._on_bytes, on_error=self._on_error,
                swarm_key=read_swarm_key(cfg.swarm_key) if cfg.swarm_key else None, stream_timeout=cfg.stream_timeout,
                join_timeout=cfg.join_timeout, stop=self.stop, reachability=cfg.reachability,
                relay_service=cfg.relay == "on",
                limits=RateLimits.from_mbit(cfg.max_upload_mbit, cfg.max_download_mbit),
                data_channel=(listen_host(cfg.listen), cfg.data_port) if cfg.data_channel == "on" else None,
            )
        except UserError:
            self.net.shutdown()
            raise
        except Exception as e:
            logger.error("could not start networking: %s. Check --listen/--initial-peers and that the port is free.", e)
            self.net.shutdown()
            return False
        if self.folder_lock is not None and self.net.transport is not None:
            self.folder_lock.set_peer(self.net.transport.peer_id)
        found = self.net.reachability
        self.summary.reachability, self.summary.reachability_detail = found.state, found.detail
        self.metrics.set_reachability(found.state)
        self.event("reachability", state=found.state, detail=found.detail)
        return True

    async def _refresh_addresses(self) -> None:
        """Once per heartbeat: this node's current multiaddrs (a private node's relay addresses appear
        once a relay holds a reservation for it), for its record and info file."""
        maddrs = await self.net.refresh_relays()
        peer_id = self.summary.peer_id
        self.summary.multiaddrs = [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in maddrs]
        self.metrics.relay_circuits.set(len(self.net.reachability.relays))

    def _own_multiaddrs(self) -> list[str]:
        """This node's visible multiaddrs, each ending in ``/p2p/<peer id>``."""
        net, peer_id = self.net, self.summary.peer_id
        assert net.p2p is not None
        return [str(a) if "/p2p/" in str(a) else f"{a}/p2p/{peer_id}" for a in net.call(net.p2p.get_visible_maddrs(latest=True))]

    def _print_join_hint(self) -> None:
        """The line that tells a volunteer on another machine how to join this node's run."""
        what, extra = self._join_hint()
        peers = " ".join(f"--initial-peers {a}" for a in dialable_addresses(self.summary.multiaddrs)[:2])
        print(f"locomesh node {self.summary.peer_id} is up{what}. Others can join with:\n"
              f"  node join --run-id {self.cfg.run_id}{extra} {peers}", flush=True)
