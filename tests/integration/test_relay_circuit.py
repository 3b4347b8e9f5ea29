"""A relay cannot tamper with what it carries, with real daemons on loopback.

Four p2pd: a target T (behind a "NAT": nobody but its relays knows its address), an honest relay R, a
hostile relay E and a client C that reaches T only through a relay. Through R the request is served and
the answer arrives intact. E runs its own relay code: when it names another origin, T refuses before any
handler runs; when it flips one byte of T's answer, C refuses the answer. Without protocol.circuit the
first would be served as the other peer and the second would be read as valid data. Both ends run a data
channel (protocol.datachannel) for the bulk protocol asked, and C still goes through the relay: a peer
reached through a relay is never dialled directly.
"""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P, PeerID

from protocol import ids
from protocol.auth import client_hello
from protocol.errors import AuthError, RemoteError
from protocol.frames import FramedStream
from protocol.hivemind_transport import Transport
from protocol.peer_identity import identified_p2p
from tests.helpers.memory_transport import byte_flipper

BLOB = bytes(range(256)) * 80  # a 20 KiB answer: far past the circuit handshake's bytes


async def _peer(initial: list[str], relay: bool | None, hidden: bool = False) -> tuple[P2P, Transport]:
    """A daemon with a transport; ``hidden``: it announces only a closed port, so peers that learn of it
    cannot dial it and the connections it opened itself (to ``initial``) are the only way in, as behind NAT."""
    hide = {"announce_maddrs": ["/ip4/127.0.0.1/tcp/1"]} if hidden else {}
    p2p, signer = await identified_p2p(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], **hide)
    transport = Transport(p2p, identity=signer.identity, idle_timeout=10)
    if relay is not None:
        await transport.enable_relays(serve_relay=relay)
    if relay is False:  # the target and the client: both could take a direct data channel for STATE, were it not for the relay
        await transport.enable_data_channel("127.0.0.1")
    return p2p, transport


async def _maddr(p2p: P2P) -> str:
    return f"{(await p2p.get_visible_maddrs())[0]}"


def _hostile_hop(evil: Transport, origin: str | None, tamper) -> object:
    """A relay hop that names ``origin`` instead of the real client (None: the real one) and passes the
    target's bytes through ``tamper`` on their way to the client."""

    async def copy(source, sink, change) -> None:
        while chunk := await source.read(1 << 16):
            sink.write(change(chunk))
            await sink.drain()

    async def hop(stream: FramedStream) -> None:
        msg = await stream.recv(expect="relay")
        target, protocol = msg.body["target"], msg.body["protocol"]
        _, reader, writer = await evil.p2p.call_binary_stream_handler(PeerID.from_base58(target), ids.RELAYED)
        leg = FramedStream(reader, writer, peer=target)
        await client_hello(leg, None, ids.RELAYED, evil.peer_id, target)
        await leg.send("relayed", {"from": origin or stream.peer, "protocol": protocol})
        await leg.recv(expect="relay_ok")
        await stream.send("relay_ok", {})
        up = asyncio.ensure_future(copy(stream.reader, leg.writer, lambda c: c))
        down = asyncio.ensure_future(copy(leg.reader, stream.writer, tamper))
        await asyncio.wait({up, down}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        up.cancel(), down.cancel()
        await leg.close()

    return hop


def test_a_relay_can_neither_name_another_origin_nor_change_the_answer() -> None:
    async def run() -> dict:
        daemons: list[P2P] = []
        try:
            r_p2p, relay = await _peer([], relay=True)
            e_p2p, evil = await _peer([], relay=None)
            daemons += [r_p2p, e_p2p]
            boots = [await _maddr(r_p2p), await _maddr(e_p2p)]
            t_p2p, target = await _peer(boots, relay=False, hidden=True)
            c_p2p, client = await _peer(boots, relay=False)
            daemons += [t_p2p, c_p2p]
            served: list[str] = []

            async def state(stream: FramedStream) -> None:
                await stream.recv(expect="get_state")
                served.append(stream.peer)
                await stream.send("state", {"blob": BLOB})

            await target.serve(ids.STATE, state)

            async def ask(via: Transport) -> bytes:
                client.routes = {target.peer_id: [via.peer_id]}
                stream = await asyncio.wait_for(client.open(target.peer_id, ids.STATE), 30)
                try:
                    assert stream.relay == via.peer_id  # not a direct stream: C does not know T's address
                    assert client.data_channel is not None and client.data_channel.opened == 0  # nor T's data channel
                    await stream.send("get_state", {"run_id": "r"})
                    return (await asyncio.wait_for(stream.recv(expect="state"), 30)).body["blob"]
                finally:
                    await stream.close()

            out: dict = {"honest": await ask(relay) == BLOB, "served_honest": list(served)}

            impostor = r_p2p.peer_id.to_base58()  # E says the stream comes from R
            await evil.serve(ids.RELAY, _hostile_hop(evil, impostor, lambda c: c))
            with pytest.raises(RemoteError) as refused:
                await ask(evil)
            out["impostor"] = (refused.value.remote_code, str(refused.value))

            evil.handlers.pop(ids.RELAY)
            await e_p2p.remove_binary_stream_handler(ids.RELAY)
            evil.protocols.remove(ids.RELAY)
            await evil.serve(ids.RELAY, _hostile_hop(evil, None, byte_flipper(4000, 0x40)))
            with pytest.raises(AuthError) as tampered:
                await ask(evil)
            out["tampered"] = str(tampered.value)
            out["served"] = served
            out["ids"] = (client.peer_id, impostor)
            return out
        finally:
            for p2p in daemons:
                await p2p.shutdown()

    out = asyncio.run(run())
    client_id, impostor = out["ids"]
    assert out["honest"] and out["served_honest"] == [client_id]
    assert out["impostor"][0] == "auth" and f"not of {impostor}" in out["impostor"][1], out["impostor"]
    assert impostor not in out["served"]  # T never ran its handler for the named origin
    assert "failed its end-to-end check" in out["tampered"]
    assert out["served"] == [client_id, client_id]  # the tampered answer was served to the real client
