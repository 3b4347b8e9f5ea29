"""The direct data channel (protocol.datachannel) with real daemons on loopback: bulk streams take it,
sealed; a frame altered or replayed on the way is refused; a peer with another identity at either end
is refused (a client then falls back to its libp2p stream); a peer reached through a relay keeps the relay.

A TCP proxy stands for the network between two peers: each client is pointed at it (its cache of the
peer's channel address), and it passes, records, alters or replays whole frames.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Callable

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from protocol import circuit, ids
from protocol.datachannel import CONTEXT
from protocol.errors import AuthError, RemoteError
from protocol.frames import FramedStream
from protocol.hivemind_transport import Transport
from protocol.peer_identity import identified_p2p

MARK = b"plain-weights!" * 4
BLOB = MARK * 2000  # ~110 KB: many TCP segments, far past the handshake's bytes
Frames = Callable[[list[bytes]], list[bytes]]  # what the proxy makes of the frames seen so far in one direction


async def _peer(initial: list[str]) -> tuple[P2P, Transport, list[tuple[str, str, str]]]:
    p2p, signer = await identified_p2p(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    errors: list[tuple[str, str, str]] = []
    transport = Transport(p2p, identity=signer.identity, idle_timeout=10, on_error=lambda *e: errors.append(e))
    await transport.enable_data_channel("127.0.0.1")
    return p2p, transport, errors


class _Proxy:
    """Passes whole frames (4-byte length + body) between a client and ``port``; ``up``/``down`` may
    rewrite each direction's frames, given all of them so far (the new frame last)."""

    def __init__(self, port: int, up: Frames | None = None, down: Frames | None = None) -> None:
        self.port, self.up, self.down = port, up, down
        self.seen = bytearray()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._pair, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _pair(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        r2, w2 = await asyncio.open_connection("127.0.0.1", self.port)
        await asyncio.wait([asyncio.ensure_future(self._pump(reader, w2, self.up)),
                            asyncio.ensure_future(self._pump(r2, writer, self.down))], return_when=asyncio.FIRST_COMPLETED)
        writer.close(), w2.close()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, rewrite: Frames | None) -> None:
        frames: list[bytes] = []
        try:
            while True:
                head = await source.readexactly(4)
                frame = head + await source.readexactly(struct.unpack(">I", head)[0])
                frames.append(frame)
                self.seen += frame
                for out in (rewrite(frames) if rewrite else [frame]):
                    sink.write(out)
                await sink.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            sink.close()


async def _state_server(transport: Transport, served: list[str]) -> None:
    async def state(stream: FramedStream) -> None:
        await stream.recv(expect="get_state")
        served.append(stream.peer)
        await stream.send("state", {"blob": BLOB})

    async def status(stream: FramedStream) -> None:
        await stream.recv()

    await transport.serve(ids.STATE, state)
    await transport.serve(ids.STATUS, status)


async def _ask(client: Transport, target: str) -> tuple[bytes, str]:
    stream = await asyncio.wait_for(client.open(target, ids.STATE), 30)
    try:
        await stream.send("get_state", {"run_id": "r"})
        return (await asyncio.wait_for(stream.recv(expect="state"), 30)).body["blob"], stream.remote_addr
    finally:
        await stream.close()


def _through(client: Transport, target: Transport, port: int) -> None:
    """Point ``client`` at ``port`` for ``target``'s data channel (as if the network led there)."""
    assert client.data_channel is not None
    client.data_channel._addresses[target.peer_id] = (time.monotonic() + 300, ("127.0.0.1", port))


def _run(scenario: Callable[[Transport, Transport, list, list], object]) -> dict:
    async def run() -> dict:
        daemons: list[P2P] = []
        try:
            t_p2p, target, target_errors = await _peer([])
            daemons.append(t_p2p)
            c_p2p, client, _ = await _peer([str((await t_p2p.get_visible_maddrs())[0])])
            daemons.append(c_p2p)
            served: list[str] = []
            await _state_server(target, served)
            return await scenario(client, target, served, target_errors)  # type: ignore[misc]
        finally:
            for p2p in daemons:
                await p2p.shutdown()

    return asyncio.run(run())


def test_bulk_streams_take_the_data_channel_sealed_and_authenticated() -> None:
    async def scenario(client: Transport, target: Transport, served: list, _errors: list) -> dict:
        blob, addr = await _ask(client, target.peer_id)  # asks where the channel is over libp2p, then dials it
        assert target.data_channel is not None
        proxy = _Proxy(target.data_channel.port)
        _through(client, target, await proxy.start())
        blob2, _ = await _ask(client, target.peer_id)
        status = await asyncio.wait_for(client.open(target.peer_id, ids.STATUS), 30)  # not a bulk protocol
        await status.close()
        return {"blobs": [blob, blob2], "addr": addr, "port": target.data_channel.port, "served": served,
                "client": client.peer_id, "opened": client.data_channel.opened, "wire": bytes(proxy.seen),
                "status_addr": status.remote_addr}

    out = _run(scenario)
    assert out["blobs"] == [BLOB, BLOB]
    assert out["addr"] == f"/ip4/127.0.0.1/tcp/{out['port']}" and out["opened"] == 2
    assert out["served"] == [out["client"]] * 2  # the handler saw the authenticated peer id
    assert MARK not in out["wire"] and len(out["wire"]) > len(BLOB)  # sealed, not only signed
    assert str(out["port"]) not in out["status_addr"]  # other protocols stay on libp2p streams


def test_a_frame_altered_on_the_way_is_refused() -> None:
    def flip_answer(frames: list[bytes]) -> list[bytes]:
        frame = frames[-1]
        if len(frame) > 50_000:  # the sealed state answer: one bit of its body flipped
            frame = frame[:1000] + bytes([frame[1000] ^ 0x10]) + frame[1001:]
        return [frame]

    async def scenario(client: Transport, target: Transport, served: list, _errors: list) -> dict:
        proxy = _Proxy(target.data_channel.port, down=flip_answer)  # type: ignore[union-attr]
        _through(client, target, await proxy.start())
        with pytest.raises(AuthError) as refused:
            await _ask(client, target.peer_id)
        return {"refused": str(refused.value)}

    assert "failed its end-to-end check" in _run(scenario)["refused"]


def test_a_replayed_frame_is_refused_before_any_handler_runs() -> None:
    # client → target frames: data_open, circuit_hello, circuit_auth, hello (sealed), get_state (sealed)
    def replay_hello(frames: list[bytes]) -> list[bytes]:
        return [frames[3]] if len(frames) == 5 else [frames[-1]]  # the request replaced by the sealed hello again

    async def scenario(client: Transport, target: Transport, served: list, errors: list) -> dict:
        proxy = _Proxy(target.data_channel.port, up=replay_hello)  # type: ignore[union-attr]
        _through(client, target, await proxy.start())
        with pytest.raises((RemoteError, ConnectionError, EOFError, asyncio.IncompleteReadError)):
            await _ask(client, target.peer_id)
        await asyncio.sleep(0.5)
        return {"served": served, "errors": errors}

    out = _run(scenario)
    assert out["served"] == []
    assert any(protocol == ids.STATE and code == "auth" for protocol, code, _ in out["errors"]), out["errors"]


def test_a_peer_with_another_identity_is_refused_at_either_end() -> None:
    async def scenario(client: Transport, target: Transport, served: list, errors: list) -> dict:
        out: dict = {}
        # a stranger at the address the client dials, answering as the target with its own key: the client
        # refuses it and falls back to its libp2p stream
        async def pose_as_target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            stream = FramedStream(reader, writer, peer="?")
            opened = (await stream.recv(expect="data_open")).body
            try:
                await circuit.target_handshake(stream, RSAPrivateKey(), opened["protocol"], opened["from"], opened["to"],
                                               context=CONTEXT, aead=AESGCM)
            except Exception:
                pass
            await stream.close()

        impostor = await asyncio.start_server(pose_as_target, "127.0.0.1", 0)
        _through(client, target, impostor.sockets[0].getsockname()[1])
        blob, addr = await _ask(client, target.peer_id)
        out["fallback"] = (blob == BLOB, addr, client.data_channel.fallbacks, str(target.data_channel.port))  # type: ignore[union-attr]
        impostor.close()
        # a client that names the real client's id but holds another key: refused, no handler runs
        reader, writer = await asyncio.open_connection("127.0.0.1", target.data_channel.port)  # type: ignore[union-attr]
        raw = FramedStream(reader, writer, peer=target.peer_id)
        await raw.send("data_open", {"from": client.peer_id, "to": target.peer_id, "protocol": ids.STATE})
        with pytest.raises((RemoteError, AuthError)) as refused:
            await asyncio.wait_for(circuit.client_handshake(raw, RSAPrivateKey(), ids.STATE, client.peer_id, target.peer_id,
                                                            context=CONTEXT, aead=AESGCM), 10)
            await raw.send("get_state", {"run_id": "r"})
            await raw.recv()
        await raw.close()
        await asyncio.sleep(0.5)
        out["refused"], out["served"], out["errors"] = str(refused.value), list(served), list(errors)
        return out

    out = _run(scenario)
    ok, addr, fallbacks, port = out["fallback"]
    assert ok and fallbacks == 1 and port not in addr  # served over p2pd after the channel failed its check
    assert "data" in out["refused"] or "key" in out["refused"] or "sign" in out["refused"], out["refused"]
    assert len(out["served"]) == 1  # only the libp2p request; the impostor's never reached the handler
    assert any(code == "auth" for _, code, _ in out["errors"]), out["errors"]
