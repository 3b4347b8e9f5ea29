"""A direct TCP data channel beside p2pd for the bulk protocols: a round's exchange and state downloads.

Every libp2p stream crosses two extra hops: this process → p2pd over a unix socket, p2pd → p2pd over
the network (encrypted by libp2p), p2pd → the peer's process. For a dense round of an 85 M-parameter
model those copies, not the link, set the pace. So two peers that already hold a direct libp2p
connection also open plain TCP connections to each other for the bulk protocols (``DATA_PROTOCOLS``):

1. The client asks the peer over libp2p (``/locomesh/data/1.0``: ``data_where`` → ``data_here {port}``)
   where its data channel listens; the host is the one its libp2p connection reaches (never a relay
   circuit: a peer reached through a relay keeps its libp2p streams). The answer is kept a while.
2. It connects, names itself, the target and the protocol (``data_open``), and both ends run the
   signed ephemeral Diffie-Hellman of ``protocol.circuit`` bound to their libp2p identity keys (its own
   context label, AES-256-GCM): each end proves it holds the key its peer id derives from, and every
   later frame is sealed with a counter nonce. A stranger at the port, a peer naming another id, an
   altered, reordered or replayed frame: the handshake or the next frame fails, and nothing reaches a
   handler. The private-swarm hello (``protocol.auth``) then runs inside the sealed channel.
3. The stream is served by the same ``Transport.handle`` as a libp2p stream: the same per-client
   caps, keyed on the authenticated peer id, the same bandwidth caps and byte accounting.

A client that cannot reach the port (a firewall, NAT, an older peer) uses its libp2p stream instead and
does not try that peer's channel again for ``RETRY_S``. Handshakes not yet authenticated are capped
(``MAX_PENDING``) and bounded in time (``HANDSHAKE_TIMEOUT_S``): an RSA signature is the most a
stranger can make a node spend per connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any, Awaitable, Callable, Protocol

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from protocol import circuit, ids
from protocol.auth import client_hello
from protocol.errors import ProtocolError, SchemaError
from protocol.frames import HELLO_MAX_FRAME, FramedStream, require
from protocol.ratelimit import RateLimits
from protocol.socket_stream import socket_pair

logger = logging.getLogger(__name__)

DATA = ids.protocol_id("data")  # where a peer's data channel listens
DATA_PROTOCOLS = (ids.AVERAGE, ids.STATE)  # the protocols that move payloads large enough to pay for a connection
CONTEXT = b"locomesh-data/1"  # the handshake's label: a data-channel transcript is no relay circuit's
RETRY_S = 600.0  # a peer whose channel could not be used is reached over libp2p this long
ADDRESS_TTL_S = 300.0  # how long a peer's answer to data_where is kept
HANDSHAKE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 3.0
MAX_PENDING = 32  # connections not yet authenticated, at once
SOCKET_BUFFER = 4 << 20  # bytes the kernel may buffer per direction (a part of a dense round is 4 MB)


class ChannelHost(Protocol):
    """What the data channel needs from the node's transport (``protocol.hivemind_transport.Transport``)."""

    peer_id: str
    identity: Any  # the node's RSA identity key (hivemind's RSAPrivateKey)
    swarm_key: bytes | None
    stall_timeout: float
    idle_timeout: float
    max_frame: int
    limits: RateLimits
    handlers: dict[str, Callable[[FramedStream], Awaitable[None]]]

    def account(self, protocol: str, stream: FramedStream) -> None: ...

    def on_error(self, protocol: str, code: str, peer: str) -> None: ...

    async def serve(self, protocol: str, handler: Callable[[FramedStream], Awaitable[None]]) -> None: ...

    async def handle(self, protocol: str, handler: Callable[[FramedStream], Awaitable[None]],
                     stream: FramedStream, client: str) -> None: ...

    async def open_libp2p(self, peer_id: str, protocol: str) -> FramedStream: ...


def dial_host(remote_addr: str) -> str | None:
    """The IP a libp2p connection's remote multiaddr reaches (``/ip4/H/tcp/P`` or ``/ip6/H/tcp/P``), or
    None for a relay circuit or any other transport."""
    parts = remote_addr.split("/")
    if "p2p-circuit" in parts or len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp":
        return None
    return parts[2]


def listen_host(listen: list[str]) -> str:
    """The address the data channel listens on: the host of the first TCP multiaddr p2pd listens on
    (``0.0.0.0``, every interface, when none names one)."""
    for maddr in listen:
        host = dial_host(maddr)
        if host is not None:
            return host
    return "0.0.0.0"


class DataChannel:
    """The data channel of one node: a TCP listener for peers, and connections to theirs.

    :param transport: the node's transport (its identity key, handlers, caps and accounting)
    :param host: the address to listen on (``0.0.0.0``: every interface)
    :param port: the port to listen on (0: any free one; peers learn it over libp2p)
    """

    def __init__(self, transport: ChannelHost, host: str = "0.0.0.0", port: int = 0) -> None:
        if transport.identity is None:
            raise ValueError("the data channel is authenticated with the node's identity key: the transport needs identity=")
        self.transport, self.host, self.port = transport, host, port
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._addresses: dict[str, tuple[float, tuple[str, int] | None]] = {}  # peer → (until, (host, port) or None)
        self._pending = 0
        self.opened = self.fallbacks = 0  # client streams over the channel, and those that fell back to libp2p

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._listener = socket.create_server((self.host, self.port), family=family, backlog=128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop())
        await self.transport.serve(DATA, self._serve_where)

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._listener is not None:
            try:
                sock, peername = await loop.sock_accept(self._listener)
            except OSError as e:  # out of file descriptors, say: the listener stays
                logger.warning("data channel: accept failed: %s", e)
                await asyncio.sleep(0.5)
                continue
            self._spawn(self._accept(sock, peername))

    async def close(self) -> None:
        listener, self._listener = self._listener, None
        for task in list(self._tasks):
            task.cancel()
        if listener is not None:
            listener.close()

    async def _serve_where(self, stream: FramedStream) -> None:
        await stream.recv(expect="data_where")
        await stream.send("data_here", {"port": self.port})

    def _stream(self, sock: socket.socket, peer: str) -> FramedStream:
        reader, writer = self.transport.limits.pace(*socket_pair(sock, SOCKET_BUFFER))
        return FramedStream(reader, writer, peer=peer, max_frame=self.transport.max_frame,
                            idle_timeout=self.transport.idle_timeout)

    async def _accept(self, sock: socket.socket, peername: Any) -> None:
        if self._pending >= MAX_PENDING:
            sock.close()
            return
        stream = self._stream(sock, f"data channel client at {peername}")
        self._pending += 1
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                protocol, client = await self._authenticate(stream)
        except (ProtocolError, ConnectionError, EOFError, OSError, TimeoutError) as e:
            logger.info("refused a data channel connection from %s: %s: %s", peername, type(e).__name__, e)
            self.transport.on_error(DATA, getattr(e, "code", "connection"), str(peername))
            if isinstance(e, ProtocolError):
                await stream.send_error(e)  # why, in the clear: nothing was agreed to seal it with
            await stream.close()
            return
        finally:
            self._pending -= 1
        stream.inner_protocol = protocol
        try:
            await self.transport.handle(protocol, self.transport.handlers[protocol], stream, client)
        finally:
            self.transport.account(protocol, stream)
            await stream.close()

    async def _authenticate(self, stream: FramedStream) -> tuple[str, str]:
        """Read ``data_open`` and run the target's side of the handshake: (protocol, authenticated client id)."""
        msg = await stream.recv(expect="data_open", max_size=HELLO_MAX_FRAME)
        client, target, protocol = (require(msg.body, k, str) for k in ("from", "to", "protocol"))
        if target != self.transport.peer_id:
            raise SchemaError(f"this is {self.transport.peer_id}'s data channel, not {target[:64]!r}'s")
        if protocol not in DATA_PROTOCOLS or protocol not in self.transport.handlers:
            raise SchemaError(f"the data channel carries {', '.join(DATA_PROTOCOLS)} only (those this node serves)")
        stream.peer = client[:64]
        await circuit.target_handshake(stream, self.transport.identity, protocol, client, target, context=CONTEXT, aead=AESGCM)
        stream.peer = client
        return protocol, client

    async def _address(self, peer: str) -> tuple[str, int] | None:
        """Where ``peer``'s data channel listens (asked over libp2p, then kept), or None."""
        until, known = self._addresses.get(peer, (0.0, None))
        if time.monotonic() < until:
            return known
        address, keep = None, RETRY_S
        try:
            stream = await asyncio.wait_for(self.transport.open_libp2p(peer, DATA), CONNECT_TIMEOUT_S)
            try:
                await stream.send("data_where", {})
                answer = await asyncio.wait_for(stream.recv(expect="data_here"), CONNECT_TIMEOUT_S)
                port = require(answer.body, "port", int)
                host = None if stream.relay else dial_host(stream.remote_addr)
                if host is not None and 0 < port < 65536:
                    address, keep = (host, port), ADDRESS_TTL_S
            finally:
                await stream.close()
        except Exception as e:  # an older peer, a peer without a channel: its libp2p streams serve
            logger.debug("no data channel to %s: %s: %s", peer, type(e).__name__, e)
        self._addresses[peer] = (time.monotonic() + keep, address)
        return address

    def forget(self, peer: str) -> None:
        """Reach ``peer`` over libp2p for ``RETRY_S``."""
        self._addresses[peer] = (time.monotonic() + RETRY_S, None)

    async def open(self, peer: str, protocol: str) -> FramedStream | None:
        """A sealed client stream to ``peer`` speaking ``protocol`` over its data channel, or None when
        there is none (the caller opens a libp2p stream)."""
        address = await self._address(peer)
        if address is None:
            return None
        stream = None
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, address), CONNECT_TIMEOUT_S)
            stream = self._stream(sock, peer)
            stream.remote_addr = f"/{'ip6' if ':' in address[0] else 'ip4'}/{address[0]}/tcp/{address[1]}"
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                await stream.send("data_open", {"from": self.transport.peer_id, "to": peer, "protocol": protocol})
                await circuit.client_handshake(stream, self.transport.identity, protocol, self.transport.peer_id, peer,
                                               context=CONTEXT, aead=AESGCM)
        except (ProtocolError, ConnectionError, EOFError, OSError, TimeoutError) as e:
            logger.info("data channel to %s at %s:%d failed (%s: %s); using libp2p streams for %.0fs",
                        peer, *address, type(e).__name__, e, RETRY_S)
            self.forget(peer)
            self.fallbacks += 1
            if stream is not None:
                await stream.close()
            sock.close()
            return None
        stream.stall_timeout, stream.idle_timeout = self.transport.stall_timeout, None
        await client_hello(stream, self.transport.swarm_key, protocol, self.transport.peer_id, peer)
        self.opened += 1
        return stream
