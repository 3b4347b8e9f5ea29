"""``/locomesh/status/1.0``: anyone may ask a node what it is doing (used by ``node status`` and probes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from protocol import ids
from protocol.frames import FramedStream

if TYPE_CHECKING:  # the light client (py-libp2p) fetches status too: no hivemind import here
    from protocol.hivemind_transport import Transport


class Opener(Protocol):
    """Any transport that opens a locomesh stream to a peer (hivemind's or py-libp2p's adapter)."""

    def open(self, peer_id: str, protocol: str) -> Awaitable[FramedStream]: ...


class StatusService:
    """Answers ``get_status {}`` with ``status {...}`` built by ``snapshot()``."""

    def __init__(self, transport: Transport, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.transport, self.snapshot = transport, snapshot

    async def start(self) -> None:
        await self.transport.serve(ids.STATUS, self._handle)

    async def _handle(self, stream: FramedStream) -> None:
        await stream.recv(expect="get_status")
        await stream.send("status", self.snapshot())


async def fetch_status(transport: Opener, peer: str) -> dict[str, Any]:
    """Ask ``peer`` for its status (over either transport adapter)."""
    stream = await transport.open(peer, ids.STATUS)
    try:
        await stream.send("get_status", {})
        return (await stream.recv(expect="status")).body
    finally:
        await stream.close()
