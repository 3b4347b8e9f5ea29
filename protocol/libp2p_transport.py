"""Transport adapter for the light client: locomesh protocols over py-libp2p (``pip install locomesh[lite]``).

A py-libp2p host (Noise security, yamux muxer: what the nodes' go-libp2p daemon speaks) dials a node's
multiaddr and opens streams for locomesh protocol ids. Each stream is a :class:`FramedStream`, so the
framing, envelope checks, error frames and the private-swarm ``hello`` handshake are the same code
the daemon runs; only the byte I/O and timeouts are trio's here, because py-libp2p runs on trio.

Client side only: the light client dials, it never listens. Everything here runs inside
``trio.run``. This module must not import hivemind (both register the protobuf type
``crypto.pb.KeyType``, so the two cannot live in one process) nor torch.

libp2p's own log records are dropped unless ``LIBP2P_DEBUG`` is set (see py-libp2p's docs); failures
reach the caller as :class:`DialError` or stream errors instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from contextlib import asynccontextmanager
from typing import AsyncIterator

import multiaddr
import trio
from libp2p import new_swarm
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.host.basic_host import BasicHost
from libp2p.io.exceptions import IOException
from libp2p.network.config import RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux

from protocol.auth import client_hello
from protocol.errors import StreamTimeout
from protocol.frames import DEFAULT_MAX_FRAME, FramedStream, drain, read_frame

logging.getLogger("libp2p").addHandler(logging.NullHandler())  # no stray records on stderr (see module doc)

__all__ = ["DialError", "Libp2pStream", "Libp2pTransport", "open_client"]


class DialError(ConnectionError):
    """The node could not be reached or was not the expected peer.

    ``reason`` is one of ``bad_address`` (not a ``.../p2p/<peer id>`` multiaddr), ``unreachable``
    (nothing accepted the connection), ``wrong_peer`` (a node answered but with another peer id;
    ``actual_peer`` says which, when known) or ``handshake`` (the security or muxer upgrade failed).
    """

    def __init__(self, reason: str, message: str, actual_peer: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.actual_peer = reason, actual_peer


class _StreamIO:
    """The two asyncio-stream calls :class:`FramedStream` makes, over a py-libp2p stream: ``readexactly``
    (EOF as ``asyncio.IncompleteReadError``, the contract of :func:`protocol.frames.read_frame`) and a
    buffered ``write`` flushed by ``drain``. Transport failures surface as ``ConnectionError``."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._in = bytearray()
        self._out = bytearray()
        self.eof = False

    async def _fill(self, want: int) -> None:
        try:
            chunk = await self.stream.read(max(want, 1 << 16))
        except EOFError:  # libp2p's StreamEOF
            chunk = b""
        except IOException as e:  # reset, closed, muxer failure
            raise ConnectionResetError(f"stream broken: {type(e).__name__} {e}".strip()) from None
        if not chunk:
            self.eof = True
        self._in += chunk

    async def readexactly(self, n: int) -> bytes:
        while len(self._in) < n and not self.eof:
            await self._fill(n - len(self._in))
        if len(self._in) < n:
            partial = bytes(self._in)
            self._in.clear()
            raise asyncio.IncompleteReadError(partial, n)
        data = bytes(self._in[:n])
        del self._in[:n]
        return data

    async def read(self, n: int = -1) -> bytes:
        if not self._in and not self.eof:
            await self._fill(n if n > 0 else 1 << 16)
        size = len(self._in) if n < 0 else min(n, len(self._in))
        data = bytes(self._in[:size])
        del self._in[:size]
        return data

    def write(self, data: bytes) -> None:
        self._out += data

    async def drain(self) -> None:
        if not self._out:
            return
        data = bytes(self._out)
        self._out.clear()
        try:
            await self.stream.write(data)
        except IOException as e:
            raise ConnectionResetError(f"stream broken: {type(e).__name__} {e}".strip()) from None


class Libp2pStream(FramedStream):
    """A :class:`FramedStream` over a py-libp2p stream; the timeouts use trio's cancel scopes."""

    def __init__(self, stream, peer: str, max_frame: int = DEFAULT_MAX_FRAME, idle_timeout: float | None = None) -> None:
        io = _StreamIO(stream)
        super().__init__(io, io, peer=peer, max_frame=max_frame, idle_timeout=idle_timeout)  # type: ignore[arg-type]
        self.net_stream = stream

    async def _next_frame(self, max_size: int | None = None) -> bytes:
        with trio.move_on_after(math.inf if self.idle_timeout is None else self.idle_timeout):
            return await read_frame(self.reader, max_size or self.max_frame)
        raise StreamTimeout(f"no complete frame from {self.peer} within {self.idle_timeout:.0f}s")

    async def wait_peer_closed(self, timeout: float = 10.0, max_bytes: int = 1 << 22) -> None:
        with trio.move_on_after(timeout):
            try:
                await drain(self.reader, max_bytes)
            except ConnectionError:
                pass

    async def close(self) -> None:
        """Close our writing side (the peer reads EOF); never raises."""
        with trio.move_on_after(2):
            try:
                await self.net_stream.close()
            except Exception:  # a stream the peer already reset or a connection already gone
                pass


def _dial_failure(error: BaseException, expected_peer: str, maddr: str) -> DialError:
    """Turn py-libp2p's dial error (a chain of SwarmException, MultiError, SecurityUpgradeFailure, ...)
    into a :class:`DialError` that says which of the usual things went wrong."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += list(getattr(e, "errors", None) or []) + list(getattr(e, "exceptions", None) or [])
        todo += [e.__cause__, e.__context__]
    names = {type(e).__name__ for e in seen}
    text = " ".join(str(e) for e in seen)
    if "PeerIDMismatchesPubkey" in names:
        found = re.search(r"remote_peer_id_from_pubkey=(\w+)", text)
        actual = found.group(1) if found else None
        return DialError("wrong_peer", f"the node at {maddr} is {actual or 'another peer'}, not {expected_peer}", actual)
    if "SecurityUpgradeFailure" in names or "MuxerUpgradeFailure" in names:
        return DialError("handshake", f"connected to {maddr} but the libp2p handshake failed ({str(error).splitlines()[0]})")
    oserrors = [e for e in seen if isinstance(e, OSError) and e.strerror]
    why = oserrors[0].strerror if oserrors else "no connection could be opened"
    return DialError("unreachable", f"cannot reach {maddr}: {why}")


class Libp2pTransport:
    """Open locomesh protocol streams to nodes from a py-libp2p host (client side).

    :param host: a running py-libp2p host (see :func:`open_client`)
    :param swarm_key: secret of a private swarm: every stream then opens with the ``hello`` proofs
        of ``protocol.auth``, as the daemon's transport does
    """

    def __init__(self, host: BasicHost, swarm_key: bytes | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.host, self.swarm_key, self.max_frame = host, swarm_key, max_frame

    @property
    def peer_id(self) -> str:
        return self.host.get_id().to_base58()

    async def connect(self, maddr: str) -> str:
        """Dial ``maddr`` (``/ip4/.../tcp/PORT/p2p/PEER_ID``); returns the peer id. Raises :class:`DialError`."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
        except Exception as e:  # multiaddr's parse errors, InvalidAddrError, bad peer id encodings
            raise DialError("bad_address", f"{maddr!r} is not a node multiaddr like /ip4/HOST/tcp/PORT/p2p/PEER_ID ({e})") from None
        peer = info.peer_id.to_base58()
        try:
            await self.host.connect(info)
        except trio.Cancelled:
            raise
        except Exception as e:
            raise _dial_failure(e, peer, maddr) from None
        return peer

    async def open(self, peer_id: str, protocol: str) -> Libp2pStream:
        """Open a stream to a connected ``peer_id`` speaking ``protocol`` (opened with the version hello, and the key proof if keyed)."""
        try:
            raw = await self.host.new_stream(ID.from_base58(peer_id), [TProtocol(protocol)])
        except trio.Cancelled:
            raise
        except Exception as e:  # the node does not serve the protocol, or the connection dropped
            raise ConnectionError(f"{peer_id} did not open a {protocol} stream: {type(e).__name__} {e}".strip()) from None
        # client side: the caller bounds the whole exchange, as with the daemon's transport
        stream = Libp2pStream(raw, peer=peer_id, max_frame=self.max_frame)
        await client_hello(stream, self.swarm_key, protocol, self.peer_id, peer_id)
        return stream


def _new_host() -> BasicHost:
    key_pair = create_new_key_pair()
    swarm = new_swarm(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)},
        muxer_opt={TProtocol(YAMUX_PROTOCOL_ID): Yamux},  # mplex does not work against go-libp2p's daemon
        retry_config=RetryConfig(max_retries=0),  # a probe reports a refused dial at once
    )
    return BasicHost(network=swarm)


@asynccontextmanager
async def open_client(swarm_key: bytes | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> AsyncIterator[Libp2pTransport]:
    """A running py-libp2p host with a fresh identity that only dials; closed on exit. Use inside ``trio.run``."""
    host = _new_host()
    error: Exception | None = None
    async with host.run(listen_addrs=[]):
        try:
            yield Libp2pTransport(host, swarm_key=swarm_key, max_frame=max_frame)
        except Exception as e:  # re-raised below, outside libp2p's nurseries, so the caller sees it unwrapped
            error = e
    if error is not None:
        raise error
