"""State download for joiners: what a joiner already holds is not sent again, and a peer cannot make it
keep tensors it never offered."""

import asyncio

import pytest
import torch

from gossip.state_transfer import StateServer, StateSnapshot, download_state
from protocol.errors import SchemaError
from protocol.frames import FramedStream
from tests.fuzz import _frames, _stream

SHAPES = [(64, 32), (32,), (7, 3)]


class _PipeWriter:
    """The write end of an in-memory stream: bytes land in the peer's reader."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, b: bytes) -> None:
        self.reader.feed_data(b)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.reader.feed_eof()

    async def wait_closed(self) -> None:
        pass


class _PipeTransport:
    """``open`` connects to ``server``'s handler through an in-memory pipe (both ends are real FramedStreams)."""

    peer_id = "joiner"

    def __init__(self, server: StateServer) -> None:
        self.server, self.tasks = server, []
        self.served_bytes = 0

    async def open(self, peer: str, protocol: str) -> FramedStream:
        to_server, to_client = asyncio.StreamReader(), asyncio.StreamReader()
        server_side = FramedStream(to_server, _PipeWriter(to_client), peer="joiner", max_frame=1 << 22)  # type: ignore[arg-type]
        self.tasks.append(asyncio.ensure_future(self._serve(server_side)))
        return FramedStream(to_client, _PipeWriter(to_server), peer=peer, max_frame=1 << 22)  # type: ignore[arg-type]

    async def _serve(self, stream: FramedStream) -> None:
        await self.server._handle(stream)
        self.served_bytes += stream.bytes_sent

    def account(self, protocol: str, stream: FramedStream) -> None:
        pass


def _state(seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"params": [torch.randn(s, generator=g) for s in SHAPES], "outer_momentum": [torch.zeros(s) for s in SHAPES]}


def _layout(tensors: dict[str, list[torch.Tensor]]) -> dict[str, list[tuple[tuple[int, ...], torch.dtype]]]:
    return {name: [(tuple(t.shape), t.dtype) for t in ts] for name, ts in tensors.items()}


def _download(served: dict[str, list[torch.Tensor]], held: dict[str, list[torch.Tensor]] | None):
    async def go():
        server = StateServer(None, "run", progress=lambda: 3)  # type: ignore[arg-type]
        server.publish(StateSnapshot(round=4, tensors=served, fingerprint="fp", meta={}))
        transport = _PipeTransport(server)
        got = await download_state(transport, "server", "run", _layout(served), have=held)  # type: ignore[arg-type]
        await asyncio.gather(*transport.tasks)
        return got, transport.served_bytes

    return asyncio.run(go())


def _full_bytes(tensors: dict[str, list[torch.Tensor]], name: str) -> int:
    return sum(t.numel() * t.element_size() for t in tensors[name])


@pytest.mark.parametrize("held_seed, expect_reused", [(0, ["outer_momentum", "params"]), (1, ["outer_momentum"]), (None, [])])
def test_a_joiner_downloads_only_the_groups_it_does_not_hold(held_seed, expect_reused):
    served = _state(0)
    held = _state(held_seed) if held_seed is not None else None
    got, sent = _download(served, held)
    assert got.reused == expect_reused
    for name, ts in served.items():
        assert all(torch.equal(a, b) for a, b in zip(got.snapshot.tensors[name], ts)), name
    payload = sum(_full_bytes(served, n) for n in served if n not in expect_reused)
    assert payload <= sent < payload + 4096, "identical groups are not sent, the others are sent once"


def test_a_joiner_never_shares_tensors_with_what_it_held():
    served = _state(0)
    held = _state(0)
    got, _ = _download(served, held)
    got.snapshot.tensors["params"][0].add_(1.0)
    assert torch.equal(held["params"][0], served["params"][0])


def test_a_peer_that_claims_a_group_the_joiner_never_offered_is_refused():
    served = _state(0)
    head = {"round": 4, "inner_step": 0, "fingerprint": "fp", "meta": {}, "same": ["params"],
            "layout": {n: [[list(t.shape), "float32"] for t in ts] for n, ts in served.items()}}

    class Liar:
        peer_id = "joiner"

        async def open(self, peer, protocol):
            return _stream(_frames(("state", head), ("end", {})))[0]

        def account(self, protocol, stream):
            pass

    with pytest.raises(SchemaError, match="identical"):
        asyncio.run(download_state(Liar(), "server", "run", _layout(served)))  # type: ignore[arg-type]


def test_have_must_be_a_map():
    server = StateServer(None, "run", progress=lambda: 0)  # type: ignore[arg-type]
    server.publish(StateSnapshot(round=0, tensors=_state(0), fingerprint="fp", meta={}))

    async def ask() -> None:
        stream, _ = _stream(_frames(("get_state", {"run_id": "run", "have": [1, 2]})))
        await server._handle(stream)

    with pytest.raises(SchemaError, match="have"):
        asyncio.run(ask())
