"""Which host a data channel dials and listens on (protocol.datachannel): never a relay circuit."""

from __future__ import annotations

from protocol.datachannel import dial_host, listen_host


def test_a_direct_tcp_connection_names_the_host_to_dial() -> None:
    assert dial_host("/ip4/10.0.0.7/tcp/4001") == "10.0.0.7"
    assert dial_host("/ip6/::1/tcp/4001") == "::1"


def test_relay_circuits_and_other_transports_name_none() -> None:
    relay = "/ip4/1.2.3.4/tcp/4001/p2p/QmRelay/p2p-circuit"
    assert dial_host(relay) is None
    assert dial_host("/ip4/1.2.3.4/udp/4001/quic") is None
    assert dial_host("") is None and dial_host("/dns4/example.org/tcp/1") is None


def test_the_channel_listens_where_p2pd_listens() -> None:
    assert listen_host(["/ip4/127.0.0.1/tcp/0"]) == "127.0.0.1"
    assert listen_host(["/ip4/0.0.0.0/udp/0/quic", "/ip6/::/tcp/0"]) == "::"
    assert listen_host([]) == "0.0.0.0"
