"""Pure parts of reachability and relaying: p2pd settings per mode, dial-back inputs, relay routes and caps."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.runtime.reachability import answers_libp2p, observed_host, p2p_settings, relay_addresses, tcp_ports
from protocol.errors import SchemaError
from protocol.frames import FramedStream
from protocol.hivemind_transport import stream_path
from protocol.records import PeerRecord
from protocol.relay import RelayLimits, relay_routes

BOOT = "/ip4/45.1.2.3/tcp/4001/p2p/12D3KooWBoot"


def test_private_nodes_are_dht_clients_with_their_initial_peers_as_static_relays() -> None:
    kwargs, extra = p2p_settings("private", [BOOT], relay_service=True)
    assert kwargs["force_reachability"] == "private" and kwargs["dht_mode"] == "client"
    assert kwargs["use_auto_relay"] and kwargs["trusted_relays"] == [BOOT]
    assert extra == {"relayService": False, "relayDiscovery": False}


def test_public_nodes_relay_unless_told_not_to() -> None:
    kwargs, extra = p2p_settings("public", [], relay_service=True)
    assert kwargs["force_reachability"] == "public" and kwargs["dht_mode"] == "server"
    assert extra["relayService"] is True and extra["relayDataLimit"] == 1 << 30
    assert p2p_settings("public", [], relay_service=False)[1] == {"relayService": False}


def test_dialback_ports_come_from_tcp_addresses_without_circuits() -> None:
    maddrs = ["/ip4/127.0.0.1/tcp/4001/p2p/X", "/ip4/192.168.1.2/tcp/4001/p2p/X", "/ip4/1.2.3.4/tcp/5000",
              f"{BOOT}/p2p-circuit/p2p/X", "/ip4/1.2.3.4/udp/9/quic", "/ip4/1.2.3.4/tcp/0"]
    assert tcp_ports(maddrs) == [4001, 5000]


def test_the_observed_host_is_the_connection_ip_and_none_through_a_relay() -> None:
    assert observed_host("/ip4/45.9.9.9/tcp/51234") == "45.9.9.9"
    assert observed_host(f"{BOOT}/p2p-circuit") is None
    assert observed_host("garbage") is None


def test_relay_routes_come_from_announced_circuit_addresses() -> None:
    routes = relay_routes({
        "A": [f"{BOOT}/p2p-circuit/p2p/A", "/ip4/45.7.7.7/tcp/1/p2p/12D3KooWOther/p2p-circuit/p2p/A", "/ip4/192.168.1.2/tcp/5/p2p/A"],
        "B": ["/ip4/45.1.1.1/tcp/9/p2p/B"],
        "C": ["/ip4/45.1.1.1/tcp/9/p2p/C/p2p-circuit/p2p/C"],  # a peer is never its own relay
    })
    assert routes == {"A": ["12D3KooWBoot", "12D3KooWOther"]}
    assert relay_addresses([f"{BOOT}/p2p-circuit/p2p/A", "/ip4/1.1.1.1/tcp/1"]) == [f"{BOOT}/p2p-circuit/p2p/A"]


@given(st.lists(st.sampled_from("abcd"), max_size=40))
def test_relay_caps_hold_and_release_returns_every_slot(clients: list[str]) -> None:
    limits = RelayLimits(circuits_per_peer=3, circuits=7)
    admitted = []
    for client in clients:
        try:
            limits.admit(client)
        except SchemaError:
            assert sum(limits.open.values()) == 7 or limits.open.get(client) == 3
            continue
        admitted.append(client)
        assert sum(limits.open.values()) <= 7 and all(n <= 3 for n in limits.open.values())
    for client in admitted:
        limits.release(client)
    assert limits.open == {}


def test_records_carry_reachability_and_refuse_unknown_states() -> None:
    rec = PeerRecord(peer_id="P", reachability="private")
    assert PeerRecord.from_value(rec.to_value()).reachability == "private"
    old = rec.to_value()
    del old["reachability"]
    assert PeerRecord.from_value(old).reachability == "unknown"  # records of older versions
    with pytest.raises(SchemaError, match="reachability"):
        PeerRecord.from_value({**rec.to_value(), "reachability": "sometimes"})


def test_a_stream_through_a_relay_counts_as_relayed() -> None:
    stream = FramedStream(None, None)  # type: ignore[arg-type]
    assert stream_path(stream) == "direct"
    stream.remote_addr = f"{BOOT}/p2p-circuit"
    assert stream_path(stream) == "relay"
    stream.remote_addr, stream.relay = "/ip4/1.2.3.4/tcp/5", "12D3KooWBoot"
    assert stream_path(stream) == "relay"


def test_a_dialback_confirms_a_libp2p_listener_and_not_any_open_port() -> None:
    async def go() -> tuple[bool, bool, bool]:
        async def libp2p_like(reader, writer):
            writer.write(b"\x13/multistream/1.0.0\n")
            await writer.drain()
            writer.close()

        async def other(reader, writer):
            writer.write(b"SSH-2.0-OpenSSH\r\n")
            await writer.drain()
            writer.close()

        good = await asyncio.start_server(libp2p_like, "127.0.0.1", 0)
        bad = await asyncio.start_server(other, "127.0.0.1", 0)
        free = bad.sockets[0].getsockname()[1]
        async with good, bad:
            results = (await answers_libp2p("127.0.0.1", good.sockets[0].getsockname()[1]),
                       await answers_libp2p("127.0.0.1", free))
        return (*results, await answers_libp2p("127.0.0.1", free, timeout=1.0))

    libp2p, other, closed = asyncio.run(go())
    assert libp2p and not other and not closed
