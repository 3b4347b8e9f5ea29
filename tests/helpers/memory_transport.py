"""An in-memory stand-in for the p2pd transport, for unit tests of protocol logic among several members
in one process: ``open`` runs the target member's handler on the other end of a pipe of real
FramedStreams, refusals travel as error frames, and every byte is counted per member."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Awaitable, Callable

from protocol.errors import ProtocolError
from protocol.frames import FramedStream

Handler = Callable[[FramedStream], Awaitable[None]]


class PipeWriter:
    """The write end of an in-memory stream: bytes land in the peer's reader."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, b: bytes) -> None:
        self.reader.feed_data(b)

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.reader.at_eof():
            self.reader.feed_eof()

    async def wait_closed(self) -> None:
        pass


class Network:
    """The members' handlers by (peer, protocol), bytes sent per member, and members that are down
    (streams to them fail)."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[str, str], Handler] = {}
        self.sent: dict[str, int] = defaultdict(int)
        self.down: set[str] = set()
        self.tasks: list[asyncio.Task] = []

    def transport(self, peer_id: str) -> "MemoryTransport":
        return MemoryTransport(self, peer_id)


class MemoryTransport:
    """One member's transport on a :class:`Network`."""

    def __init__(self, network: Network, peer_id: str) -> None:
        self.network, self.peer_id = network, peer_id
        self.protocols: list[str] = []

    async def serve(self, protocol: str, handler: Handler) -> None:
        self.network.handlers[(self.peer_id, protocol)] = handler
        self.protocols.append(protocol)

    async def open(self, peer: str, protocol: str) -> FramedStream:
        if peer in self.network.down:
            raise ConnectionError(f"{peer} is down")
        handler = self.network.handlers.get((peer, protocol))
        if handler is None:
            raise ConnectionError(f"{peer} does not serve {protocol}")
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        server = FramedStream(to_server, PipeWriter(to_client), peer=self.peer_id, max_frame=1 << 26)  # type: ignore[arg-type]
        client = FramedStream(to_client, PipeWriter(to_server), peer=peer, max_frame=1 << 26)  # type: ignore[arg-type]
        self.network.tasks.append(asyncio.ensure_future(self._serve(peer, handler, server)))
        return client

    async def _serve(self, peer: str, handler: Handler, stream: FramedStream) -> None:
        try:
            await handler(stream)
        except ProtocolError as e:
            await stream.refuse(e)
        except (ConnectionError, EOFError, asyncio.IncompleteReadError):
            pass
        finally:
            self.network.sent[peer] += stream.bytes_sent
            await stream.close()

    def account(self, protocol: str, stream: FramedStream) -> None:
        self.network.sent[self.peer_id] += stream.bytes_sent
