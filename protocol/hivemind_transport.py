"""Transport adapter: locomesh protocols as libp2p streams of the hivemind p2pd daemon.

Each service is registered with ``P2P.add_binary_stream_handler`` under its protocol id, so any
libp2p implementation that can open a stream to the peer can speak it (the light client does).
A handler receives a :class:`FramedStream`; exceptions it raises are logged (a refused client's at most once
a minute per protocol: :mod:`protocol.refusal_log`), counted through ``on_error`` and reported to the peer as
an error frame, and never take the node down. Every
stream's bytes, served, opened or relayed, pass the node's bandwidth caps (:mod:`protocol.ratelimit`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey

from protocol import ids, relay
from protocol.auth import client_hello, server_hello
from protocol.datachannel import DATA_PROTOCOLS, DataChannel
from protocol.errors import IncompatiblePeer, ProtocolError
from protocol.frames import DEFAULT_MAX_FRAME, FramedStream
from protocol.ratelimit import RateLimits
from protocol.refusal_log import RefusalLog

logger = logging.getLogger(__name__)

Handler = Callable[[FramedStream], Awaitable[None]]
RELAY_RETRY_S = 30.0  # a relay that failed is skipped this long
MAX_STREAMS_PER_PEER = 32  # streams of one protocol one client may hold open here at once
MAX_RELAYED_STREAMS = 256  # relayed streams one of this node's relays may carry to it at once (many clients' requests)
UNCAPPED = (ids.STAGE,)  # bounded elsewhere: the stage's queue
# Requests one client may make of a protocol whose small request costs a large answer: (burst, per second).
# A whole state for 30 bytes: a joiner asks a handful of peers once, a resync tries up to 20 times.
REQUEST_RATES = {ids.STATE: (30, 0.5)}
MAX_TRACKED_CLIENTS = 4096  # request buckets kept; full ones are forgotten first


class Transport:
    """Serve and call locomesh protocols over a hivemind :class:`P2P` instance.

    :param p2p: a running P2P (this process's replica of the p2pd client)
    :param max_frame: the largest frame accepted from a peer
    :param on_bytes: ``(protocol_id, direction, nbytes, path)`` callback for traffic accounting; ``path``
        is ``"relay"`` for a stream over a circuit relay (the bytes also cross the relay's links) and
        ``"direct"`` otherwise
    :param on_error: ``(protocol_id, code, peer)`` callback for every refused or failed exchange
    :param idle_timeout: on served streams, a client that sends no complete frame for this long is
        refused (slow-loris guard)
    :param swarm_key: shared secret of a private swarm. Every stream opens with ``hello`` frames in
        both directions (``protocol.auth``): each side's versions (a peer of another protocol version is
        refused before any handler runs) and, with a key, HMAC-SHA256(key, role | protocol | client id |
        server id); libp2p already authenticates the peer ids, so a proof cannot be replayed by anyone
        else. Peers without the key are refused before any handler runs.
    :param limits: the node's upload/download caps (``protocol.ratelimit``): every stream's bytes, served,
        opened and relayed, pass through the same two buckets
    :param identity: the RSA key p2pd runs with (the one this node's peer id derives from): relayed
        streams are authenticated end to end with it and sealed (``protocol.circuit``); a transport
        without it opens and accepts direct streams only
    :param stall_timeout: on opened streams, the longest pause inside a frame the peer has begun to send
        (a server that sends part of an answer and stops is given up on; waiting for an answer to
        begin is the caller's to bound)
    """

    def __init__(
        self,
        p2p: P2P,
        max_frame: int = DEFAULT_MAX_FRAME,
        on_bytes: Callable[[str, str, int, str], None] | None = None,
        on_error: Callable[[str, str, str], None] | None = None,
        swarm_key: bytes | None = None,
        idle_timeout: float = 30.0,
        limits: RateLimits | None = None,
        identity: RSAPrivateKey | None = None,
        stall_timeout: float = 60.0,
    ) -> None:
        self.limits = limits or RateLimits()
        self.identity, self.stall_timeout = identity, stall_timeout
        self.p2p = p2p
        self.idle_timeout = idle_timeout
        self.swarm_key = swarm_key
        self.max_frame = max_frame
        self.on_bytes = on_bytes or (lambda *_: None)
        self.on_error = on_error or (lambda *_: None)
        self.protocols: list[str] = []
        self.handlers: dict[str, Handler] = {}
        self.routes: dict[str, list[str]] = {}  # {peer behind NAT: relays it announced}, kept fresh by the node
        self.relay_limits: relay.RelayLimits | None = None  # set when this node relays for others
        self.own_relays: Callable[[], set[str]] | None = None  # set by the node: who may carry relayed streams here
        self.data_channel: DataChannel | None = None  # set by enable_data_channel
        self._relay_failed: dict[str, float] = {}
        self._direct_cache: tuple[float, set[str]] = (0.0, set())
        self._active: dict[tuple[str, str], int] = {}  # (protocol, client) → streams being served
        self._requests: dict[tuple[str, str], tuple[float, float]] = {}  # (protocol, client) → (tokens, when)
        self.refusals = RefusalLog(logger)

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def serve(self, protocol: str, handler: Handler) -> None:
        """Register ``handler`` for streams opened with ``protocol`` (directly or through a relay)."""

        async def _on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            reader, writer = self.limits.pace(reader, writer)
            stream = FramedStream(reader, writer, peer=peer, max_frame=self.max_frame, idle_timeout=self.idle_timeout)
            stream.remote_addr = str(info.addr)
            try:
                await self.handle(protocol, handler, stream, peer)
            finally:
                self.account(getattr(stream, "inner_protocol", protocol), stream)
                await stream.close()

        self.handlers[protocol] = handler
        await self.p2p.add_binary_stream_handler(protocol, _on_stream)
        self.protocols.append(protocol)

    async def handle(self, protocol: str, handler: Handler, stream: FramedStream, client: str) -> None:
        """Run ``handler`` on a served stream from ``client``: the private-swarm hello first, then
        the handler; failures are logged, counted and answered with an error frame. A client may hold
        at most ``MAX_STREAMS_PER_PEER`` streams of one protocol at once (a cheap request can cost an
        expensive answer: a whole state); stage requests are bounded by the stage's own queue, and a relay's
        ``relayed`` streams, which carry many clients' requests (each also capped under its own protocol and
        origin), at ``MAX_RELAYED_STREAMS``."""
        key = (protocol, client)
        cap = MAX_RELAYED_STREAMS if protocol == ids.RELAYED else MAX_STREAMS_PER_PEER
        if protocol not in UNCAPPED and self._active.get(key, 0) >= cap:
            self.on_error(protocol, "busy", client)
            await stream.refuse("busy", f"{cap} {protocol} streams of yours are open here; wait for them")
            return
        if not self._admit_request(key):
            burst, rate = REQUEST_RATES[protocol]
            self.on_error(protocol, "busy", client)
            await stream.refuse("busy", f"more than {burst} {protocol} requests of yours in a row; "
                                        f"at most one every {1 / rate:.0f}s now")
            return
        self._active[key] = self._active.get(key, 0) + 1
        try:
            await self._handle_counted(protocol, handler, stream, client)
        finally:
            self._active[key] -= 1
            if not self._active[key]:
                del self._active[key]

    def _admit_request(self, key: tuple[str, str]) -> bool:
        """Take one request from ``key``'s bucket (protocols without a rate always pass)."""
        if key[0] not in REQUEST_RATES:
            return True
        burst, rate = REQUEST_RATES[key[0]]
        now = time.monotonic()
        tokens, stamp = self._requests.get(key, (float(burst), now))
        tokens = min(float(burst), tokens + (now - stamp) * rate)
        if tokens < 1:
            self._requests[key] = (tokens, now)
            return False
        self._requests[key] = (tokens - 1, now)
        if len(self._requests) > MAX_TRACKED_CLIENTS:  # forget the buckets that have refilled since
            full = [k for k, (t, when) in self._requests.items() if t + (now - when) * REQUEST_RATES[k[0]][1] >= REQUEST_RATES[k[0]][0]]
            for k in full or list(self._requests)[: len(self._requests) // 2]:
                self._requests.pop(k, None)
        return True

    async def _handle_counted(self, protocol: str, handler: Handler, stream: FramedStream, client: str) -> None:
        try:
            await server_hello(stream, self.swarm_key, protocol, client, self.peer_id)
            await handler(stream)
            await stream.wait_peer_closed()
        except ProtocolError as e:
            if not isinstance(e, IncompatiblePeer):  # that one's line is logged once per peer, not per stream
                self.refusals.refused(protocol, client, e)  # a line a minute per client and protocol
            self.on_error(protocol, e.code, client)
            await stream.refuse(e)
        except (ConnectionError, EOFError, asyncio.IncompleteReadError) as e:
            logger.info("%s stream from %s closed early: %s", protocol, client, e)
            self.on_error(protocol, "connection", client)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in a handler must not kill the node
            logger.exception("handler %s failed on a request from %s", protocol, client)
            self.on_error(protocol, "internal", client)
            await stream.refuse("internal", f"{type(e).__name__}: {e}")

    async def enable_relays(self, serve_relay: bool) -> None:
        """Accept streams relayed to us by public peers, and relay for others when ``serve_relay``."""
        if self.identity is None:
            raise ValueError("relayed streams are authenticated with the node's identity key: pass identity=")
        await self.serve(ids.RELAYED, lambda stream: relay.serve_relayed(self, stream))
        if serve_relay:
            self.relay_limits = relay.RelayLimits()
            await self.serve(ids.RELAY, lambda stream: relay.serve_hop(self, stream))

    async def enable_data_channel(self, host: str = "0.0.0.0", port: int = 0) -> DataChannel:
        """Serve the bulk protocols over a direct, sealed TCP channel too (:mod:`protocol.datachannel`),
        and use peers' channels for them where they can be reached."""
        self.data_channel = DataChannel(self, host, port)
        await self.data_channel.start()
        return self.data_channel

    async def open(self, peer_id: str, protocol: str) -> FramedStream:
        """Open a stream to ``peer_id`` speaking ``protocol``: a bulk protocol over the peer's data
        channel when both have one and the peer is reached directly, else a libp2p stream
        (:meth:`open_libp2p`)."""
        if self.data_channel is not None and protocol in DATA_PROTOCOLS and not await self._relays_for(peer_id):
            stream = await self.data_channel.open(peer_id, protocol)
            if stream is not None:
                return stream
        return await self.open_libp2p(peer_id, protocol)

    async def _relays_for(self, peer_id: str) -> list[str]:
        """The relays that reach ``peer_id`` (behind NAT, announced relays) when it has no direct
        connection to us; [] when it is reached directly."""
        relays = [r for r in self.routes.get(peer_id, []) if self.identity is not None
                  and r != self.peer_id and self._relay_failed.get(r, 0) < time.monotonic() - RELAY_RETRY_S]
        return relays if relays and not await self._connected_directly(peer_id) else []

    async def open_libp2p(self, peer_id: str, protocol: str) -> FramedStream:
        """Open a libp2p stream to ``peer_id`` speaking ``protocol``.

        A peer that announced relays (it is behind NAT) and has no direct connection to us is reached
        through one of them (:mod:`protocol.relay`), the next one when a relay fails; a direct stream
        is the last resort."""
        relays = await self._relays_for(peer_id)
        if relays:
            for hop in relays:
                try:
                    return await asyncio.wait_for(relay.open_via(self, hop, peer_id, protocol), 30)
                except ProtocolError:
                    raise  # the target itself refused (wrong key, unknown protocol): another relay says the same
                except Exception as e:
                    self._relay_failed[hop] = time.monotonic()
                    logger.info("relay %s could not carry %s to %s: %s %s", hop, protocol, peer_id, type(e).__name__, e)
        return await self._open_direct(peer_id, protocol)

    async def _open_direct(self, peer_id: str, protocol: str) -> FramedStream:
        info, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        reader, writer = self.limits.pace(reader, writer)
        # client side: the caller bounds the whole exchange (a server may legitimately wait for its own data)
        stream = FramedStream(reader, writer, peer=peer_id, max_frame=self.max_frame)
        stream.remote_addr, stream.stall_timeout = str(info.addr), self.stall_timeout
        await client_hello(stream, self.swarm_key, protocol, self.peer_id, peer_id)
        return stream

    async def _connected_directly(self, peer_id: str) -> bool:
        """Whether p2pd holds a connection to ``peer_id`` that is not a relay circuit (cached 2 s)."""
        stamp, direct = self._direct_cache
        if time.monotonic() - stamp > 2.0:
            try:
                peers = await self.p2p.list_peers()
            except Exception:
                peers = []
            direct = {info.peer_id.to_base58() for info in peers
                      if any("/p2p-circuit" not in str(a) for a in info.addrs)}
            self._direct_cache = (time.monotonic(), direct)
        return peer_id in direct

    def account(self, protocol: str, stream: FramedStream) -> None:
        """Report a stream's traffic (clients call it once the exchange is over)."""
        path = stream_path(stream)
        self.on_bytes(protocol, "sent", stream.bytes_sent, path)
        self.on_bytes(protocol, "received", stream.bytes_received, path)


def stream_path(stream: FramedStream) -> str:
    """``"relay"`` when the stream runs over a libp2p circuit relay, else ``"direct"``."""
    return "relay" if getattr(stream, "relay", "") or "/p2p-circuit" in stream.remote_addr else "direct"
