"""Transport adapter: locomesh protocols as libp2p streams of the hivemind p2pd daemon.

Each service is registered with ``P2P.add_binary_stream_handler`` under its protocol id, so any
libp2p implementation that can open a stream to the peer can speak it (the light client does).
A handler receives a :class:`FramedStream`; exceptions it raises are logged, counted through
``on_error`` and reported to the peer as an error frame, and never take the node down.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from hivemind.p2p import P2P, PeerID

from protocol.auth import client_hello, server_hello
from protocol.errors import ProtocolError
from protocol.frames import DEFAULT_MAX_FRAME, FramedStream

logger = logging.getLogger(__name__)

Handler = Callable[[FramedStream], Awaitable[None]]


class Transport:
    """Serve and call locomesh protocols over a hivemind :class:`P2P` instance.

    :param p2p: a running P2P (this process's replica of the p2pd client)
    :param max_frame: the largest frame accepted from a peer
    :param on_bytes: ``(protocol_id, direction, nbytes)`` callback for traffic accounting
    :param on_error: ``(protocol_id, code, peer)`` callback for every refused or failed exchange
    :param idle_timeout: on served streams, a client that sends no complete frame for this long is
        refused (slow-loris guard)
    :param swarm_key: shared secret of a private swarm. Each stream then opens with ``hello`` frames
        carrying HMAC-SHA256(key, role | protocol | client id | server id) in both directions; libp2p
        already authenticates the peer ids, so a proof cannot be replayed by anyone else (see
        ``protocol.auth``). Peers without the key are refused before any handler runs.
    """

    def __init__(
        self,
        p2p: P2P,
        max_frame: int = DEFAULT_MAX_FRAME,
        on_bytes: Callable[[str, str, int], None] | None = None,
        on_error: Callable[[str, str, str], None] | None = None,
        swarm_key: bytes | None = None,
        idle_timeout: float = 30.0,
    ) -> None:
        self.p2p = p2p
        self.idle_timeout = idle_timeout
        self.swarm_key = swarm_key
        self.max_frame = max_frame
        self.on_bytes = on_bytes or (lambda *_: None)
        self.on_error = on_error or (lambda *_: None)
        self.protocols: list[str] = []

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def serve(self, protocol: str, handler: Handler) -> None:
        """Register ``handler`` for streams opened with ``protocol``."""

        async def _on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id.to_base58()
            stream = FramedStream(reader, writer, peer=peer, max_frame=self.max_frame, idle_timeout=self.idle_timeout)
            try:
                if self.swarm_key is not None:
                    await server_hello(stream, self.swarm_key, protocol, peer, self.peer_id)
                await handler(stream)
                await stream.wait_peer_closed()
            except ProtocolError as e:
                logger.warning("refused %s request from %s: %s", protocol, peer, e)
                self.on_error(protocol, e.code, peer)
                await stream.refuse(e)
            except (ConnectionError, EOFError, asyncio.IncompleteReadError) as e:
                logger.info("%s stream from %s closed early: %s", protocol, peer, e)
                self.on_error(protocol, "connection", peer)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug in a handler must not kill the node
                logger.exception("handler %s failed on a request from %s", protocol, peer)
                self.on_error(protocol, "internal", peer)
                await stream.refuse("internal", f"{type(e).__name__}: {e}")
            finally:
                self.on_bytes(protocol, "sent", stream.bytes_sent)
                self.on_bytes(protocol, "received", stream.bytes_received)
                await stream.close()

        await self.p2p.add_binary_stream_handler(protocol, _on_stream)
        self.protocols.append(protocol)

    async def open(self, peer_id: str, protocol: str) -> FramedStream:
        """Open a stream to ``peer_id`` speaking ``protocol``."""
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol)
        # client side: the caller bounds the whole exchange (a server may legitimately wait for its own data)
        stream = FramedStream(reader, writer, peer=peer_id, max_frame=self.max_frame)
        if self.swarm_key is not None:
            await client_hello(stream, self.swarm_key, protocol, self.peer_id, peer_id)
        return stream

    def account(self, protocol: str, stream: FramedStream) -> None:
        """Report a client stream's traffic (call once the exchange is over)."""
        self.on_bytes(protocol, "sent", stream.bytes_sent)
        self.on_bytes(protocol, "received", stream.bytes_received)
