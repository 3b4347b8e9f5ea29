"""Locomesh's own stream relay: how a peer behind NAT is reached for bulk transfers.

p2pd's circuit relay resets every circuit after 128 KiB (its daemon installs a second relay with
libp2p's default limits over the configured one), so it carries only small messages. Pseudo-gradients,
state and activations go through this relay instead:

- ``/locomesh/relay/1.0`` (served by public peers unless ``--relay off``): a client sends
  ``relay {target, protocol}``. The relay opens ``/locomesh/relayed/1.0`` to the target over its
  direct connection (a private peer keeps one to each relay it announces) and sends
  ``relayed {from, protocol}``; the target answers ``relay_ok``, the relay answers ``relay_ok`` to
  the client, and from then on the relay copies bytes both ways until either side closes.
- The two ends then authenticate each other with their libp2p identity keys and seal every later
  frame (:mod:`protocol.circuit`): the relay can neither read nor change what it carries, nor name an
  origin whose key it lacks. The client then speaks ``protocol`` end to end, the version ``hello``
  included, and the target serves the request with the same handler as a direct stream.
- Caps: circuits per client and in all, and bytes per circuit. Refusals are error frames with a
  reason; a relay never relays to a peer it can reach only through a relay itself.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from hivemind.p2p import PeerID

from protocol import circuit, ids
from protocol.auth import client_hello
from protocol.errors import SchemaError
from protocol.frames import FramedStream, require
from protocol.ratelimit import RateLimits

logger = logging.getLogger(__name__)


class RelayHost(Protocol):
    """What the relay needs from the transport that serves it (``protocol.hivemind_transport.Transport``)."""

    p2p: Any  # hivemind's P2P: ``call_binary_stream_handler``
    peer_id: str
    identity: Any  # the node's RSA identity key (hivemind's RSAPrivateKey): circuits are sealed with it
    swarm_key: bytes | None
    stall_timeout: float
    max_frame: int
    idle_timeout: float
    relay_limits: "RelayLimits | None"
    limits: RateLimits  # the node's upload/download caps: relayed bytes count against them like any other
    handlers: dict[str, Callable[[FramedStream], Awaitable[None]]]
    own_relays: Callable[[], set[str]] | None  # the relays holding this node's reservations (None: any carrier)

    def account(self, protocol: str, stream: FramedStream) -> None: ...

    async def handle(self, protocol: str, handler: Callable[[FramedStream], Awaitable[None]],
                     stream: FramedStream, client: str) -> None: ...


@dataclass
class RelayLimits:
    """What a public peer relays at most."""

    circuits_per_peer: int = 16
    circuits: int = 128
    bytes_per_circuit: int = 1 << 30
    seconds_per_circuit: float = 1800.0  # a circuit is cut after 30 minutes, however busy
    idle_seconds: float = 120.0  # ... and after this long with no byte either way (held slots are freed)
    open: dict[str, int] = field(default_factory=dict)  # live circuits by client

    def admit(self, client: str) -> None:
        if sum(self.open.values()) >= self.circuits:
            raise SchemaError(f"relay busy: {self.circuits} circuits open")
        if self.open.get(client, 0) >= self.circuits_per_peer:
            raise SchemaError(f"relay busy: {self.circuits_per_peer} circuits open for you")
        self.open[client] = self.open.get(client, 0) + 1

    def release(self, client: str) -> None:
        left = self.open.get(client, 1) - 1
        if left > 0:
            self.open[client] = left
        else:
            self.open.pop(client, None)


class RelayLimitExceeded(ConnectionError):
    """A circuit carried more than its byte cap."""


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter, limit: int, moved: list[int], i: int,
                activity: list[float]) -> None:
    """Copy ``source`` to ``sink`` until EOF, counting into ``moved[i]`` and stamping ``activity[0]``."""
    while True:
        chunk = await source.read(1 << 16)
        if not chunk:
            return
        moved[i] += len(chunk)
        activity[0] = time.monotonic()
        if moved[i] > limit:
            raise RelayLimitExceeded(f"circuit passed its cap of {limit} bytes")
        sink.write(chunk)
        await sink.drain()


async def splice(client: FramedStream, target: FramedStream, limit: int, max_seconds: float = math.inf,
                 idle_seconds: float = math.inf) -> tuple[int, int]:
    """Copy bytes both ways until one side closes, ``max_seconds`` pass, or no byte moves either way for
    ``idle_seconds``; returns (bytes client→target, target→client)."""
    moved, activity = [0, 0], [time.monotonic()]
    up = asyncio.ensure_future(_copy(client.reader, target.writer, limit, moved, 0, activity))
    down = asyncio.ensure_future(_copy(target.reader, client.writer, limit, moved, 1, activity))
    give_up = time.monotonic() + max_seconds
    try:
        # the client closes only once it has read its whole answer, so its EOF ends the circuit
        while True:
            now = time.monotonic()
            wait = min(give_up - now, activity[0] + idle_seconds - now)
            if wait <= 0:
                why = "time cap" if give_up <= now else "idle timeout"
                logger.info("relay circuit %s -> %s cut: %s", client.peer, target.peer, why)
                break
            done, _ = await asyncio.wait({up, down}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if done:
                break
    finally:
        for task in (up, down):
            task.cancel()
        await asyncio.gather(up, down, return_exceptions=True)
    return moved[0], moved[1]


async def serve_hop(transport: RelayHost, stream: FramedStream) -> None:
    """The relay's side of ``/locomesh/relay/1.0``."""
    limits = transport.relay_limits
    if limits is None:
        raise SchemaError("this node does not relay (--relay off or not publicly reachable)")
    msg = await stream.recv(expect="relay")
    target = require(msg.body, "target", str)
    protocol = require(msg.body, "protocol", str)
    if protocol in (ids.RELAY, ids.RELAYED) or target in (stream.peer, transport.peer_id):
        raise SchemaError(f"cannot relay {protocol} to {target}")
    limits.admit(stream.peer)
    try:
        try:
            info, reader, writer = await asyncio.wait_for(
                transport.p2p.call_binary_stream_handler(PeerID.from_base58(target), ids.RELAYED), 10)
        except Exception as e:
            raise SchemaError(f"relay could not reach {target}: {type(e).__name__}") from None
        reader, writer = transport.limits.pace(reader, writer)
        leg = FramedStream(reader, writer, peer=target, max_frame=transport.max_frame, idle_timeout=transport.idle_timeout)
        leg.remote_addr = str(info.addr)
        try:
            if "/p2p-circuit" in leg.remote_addr:
                raise SchemaError(f"relay reaches {target} only through another relay")
            await client_hello(leg, transport.swarm_key, ids.RELAYED, transport.peer_id, target)
            await leg.send("relayed", {"from": stream.peer, "protocol": protocol})
            await asyncio.wait_for(leg.recv(expect="relay_ok"), 10)
            await stream.send("relay_ok", {})
            up, down = await splice(stream, leg, limits.bytes_per_circuit, limits.seconds_per_circuit, limits.idle_seconds)
            stream.bytes_received += up
            stream.bytes_sent += down
            stream.relay = transport.peer_id  # what this node relayed counts as relayed traffic
        finally:
            transport.account(ids.RELAYED, leg)
            await leg.close()
    finally:
        limits.release(stream.peer)


async def serve_relayed(transport: RelayHost, stream: FramedStream) -> None:
    """The target's side: a relay forwards a client's stream for one of our protocols."""
    if transport.own_relays is not None and stream.peer not in transport.own_relays():
        # only the relays this node chose carry streams to it: any connected peer could otherwise name a fresh
        # origin per stream, and no per-client limit would ever bind
        raise SchemaError(f"{stream.peer} is not a relay of this node")
    msg = await stream.recv(expect="relayed")
    origin = require(msg.body, "from", str)
    protocol = require(msg.body, "protocol", str)
    handler = transport.handlers.get(protocol)
    if handler is None or protocol in (ids.RELAY, ids.RELAYED):
        raise SchemaError(f"this node does not serve {protocol}")
    await stream.send("relay_ok", {})
    stream.relay, stream.peer, stream.inner_protocol = stream.peer, origin, protocol
    await circuit.target_handshake(stream, transport.identity, protocol, origin, transport.peer_id)
    await transport.handle(protocol, handler, stream, origin)


async def open_via(transport: RelayHost, relay: str, target: str, protocol: str) -> FramedStream:
    """A client stream to ``target`` speaking ``protocol``, carried by ``relay``."""
    info, reader, writer = await transport.p2p.call_binary_stream_handler(PeerID.from_base58(relay), ids.RELAY)
    reader, writer = transport.limits.pace(reader, writer)
    stream = FramedStream(reader, writer, peer=relay, max_frame=transport.max_frame)
    stream.remote_addr, stream.stall_timeout = str(info.addr), transport.stall_timeout
    try:
        await client_hello(stream, transport.swarm_key, ids.RELAY, transport.peer_id, relay)
        await stream.send("relay", {"target": target, "protocol": protocol})
        await asyncio.wait_for(stream.recv(expect="relay_ok"), 20)
        stream.peer, stream.relay = target, relay
        await asyncio.wait_for(circuit.client_handshake(stream, transport.identity, protocol, transport.peer_id, target), 20)
        await client_hello(stream, transport.swarm_key, protocol, transport.peer_id, target)
        return stream
    except BaseException:
        await stream.close()
        raise


def relay_routes(records: dict[str, list[str]]) -> dict[str, list[str]]:
    """{private peer: relay peer ids} from each peer's announced multiaddrs (``…/p2p/R/p2p-circuit/p2p/P``)."""
    routes: dict[str, list[str]] = {}
    for peer, maddrs in records.items():
        relays = relays_in(maddrs, peer)
        if relays:
            routes[peer] = relays
    return routes


def relays_in(maddrs: list[str], peer: str) -> list[str]:
    """The relay peer ids of ``peer``'s circuit multiaddrs (``…/p2p/R/p2p-circuit/p2p/P``), in order."""
    relays: list[str] = []
    for maddr in maddrs:
        head, sep, _ = str(maddr).partition("/p2p-circuit")
        if sep and "/p2p/" in head:
            relay = head.rsplit("/p2p/", 1)[1]
            if relay and relay != peer and relay not in relays:
                relays.append(relay)
    return relays
