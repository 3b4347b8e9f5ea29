"""A reader/writer pair straight on a non-blocking socket, for the data channel's bulk frames.

asyncio's streams copy every byte twice on its way: a received chunk into the ``StreamReader``'s
buffer and out again, and a write the socket cannot take at once into the transport's buffer. For a
round's 4 MB parts those copies cost more CPU than sealing them. Here a frame's body is received
straight into the buffer that becomes the frame (``readinto``), and written pieces are sent from the
caller's own buffers (``loop.sock_sendall``, which waits for the socket instead of copying).

The pair speaks the subset of ``asyncio.StreamReader``/``StreamWriter`` that ``protocol.frames``,
``protocol.ratelimit`` and the transports use, so a ``FramedStream`` runs on it unchanged.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any


class SocketReader:
    """Reads from a connected non-blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.loop = sock, asyncio.get_running_loop()

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (at least one), b"" at the end of the stream."""
        try:
            return await self.loop.sock_recv(self.sock, n if n > 0 else 1 << 16)
        except (ConnectionResetError, BrokenPipeError):
            return b""

    async def readinto(self, view: memoryview) -> int:
        """Receive into ``view`` (at least one byte); 0 at the end of the stream."""
        try:
            return await self.loop.sock_recv_into(self.sock, view)
        except (ConnectionResetError, BrokenPipeError):
            return 0

    async def readexactly(self, n: int) -> bytearray:
        body = bytearray(n)
        view, got = memoryview(body), 0
        while got < n:
            k = await self.readinto(view[got:])
            if not k:
                raise asyncio.IncompleteReadError(bytes(body[:got]), n)
            got += k
        return body


class SocketWriter:
    """Writes to a connected non-blocking socket: ``write`` queues the caller's buffers (no copy; they
    must not change until ``drain`` returns), ``drain`` sends them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.loop = sock, asyncio.get_running_loop()
        self.pending: list[Any] = []
        self.closed = False

    def write(self, data: Any) -> None:
        if self.closed:
            raise ConnectionResetError("the socket is closed")
        self.pending.append(data)

    async def drain(self) -> None:
        while self.pending:
            await self.loop.sock_sendall(self.sock, self.pending.pop(0))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    async def wait_closed(self) -> None:
        return None

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self.sock
        if name == "peername":
            try:
                return self.sock.getpeername()
            except OSError:
                return default
        return default


def socket_pair(sock: socket.socket, buffer: int) -> tuple[SocketReader, SocketWriter]:
    """A reader and writer on ``sock`` (made non-blocking, without Nagle, with ``buffer`` bytes of kernel
    buffer each way)."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, buffer)
    return SocketReader(sock), SocketWriter(sock)
