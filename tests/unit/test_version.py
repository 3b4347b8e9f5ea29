"""Mixed versions: the compatibility rule, its one log line per peer, and the hello that refuses a peer of
another protocol version (or one older than the hello) before any handler runs."""

import asyncio
import logging

import pytest

from protocol import ids
from protocol.auth import client_hello, hello_body, server_hello
from protocol.errors import IncompatiblePeer
from protocol.frames import decode_message, encode_frame, encode_message
from protocol.records import PeerRecord, RoundEntry
from protocol.version import PROTOCOL_VERSION, compatible, incompatibility, note_incompatible, protocol_version
from tests.helpers.memory_transport import canned_stream

STATE = ids.STATE


def _frame(kind: str, body: dict) -> bytes:
    return encode_frame(encode_message(kind, body))


def _sent(sink) -> list:
    """The envelopes written to a canned stream's sink."""
    data, out = bytes(sink.data), []
    while data:
        n = int.from_bytes(data[:4], "big")
        out.append(decode_message(data[4 : 4 + n]))
        data = data[4 + n :]
    return out


def test_same_protocol_is_compatible_whatever_the_package_version() -> None:
    assert compatible(PROTOCOL_VERSION) and not compatible(PROTOCOL_VERSION + 1) and not compatible(1)
    assert incompatibility("12D3KooWpeer", "0.9.7", PROTOCOL_VERSION) is None  # another package version, same protocol
    older = incompatibility("12D3KooWpeer", "0.1.0", PROTOCOL_VERSION - 1)
    assert older is not None and f"0.1.0 (protocol {PROTOCOL_VERSION - 1})" in older and f"(protocol {PROTOCOL_VERSION})" in older
    assert "upgrade that peer with `git pull && make setup`" in older
    newer = incompatibility("12D3KooWpeer", "9.0.0", PROTOCOL_VERSION + 1)
    assert newer is not None and "upgrade this node" in newer


def test_the_fake_protocol_version_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCOMESH_FAKE_PROTOCOL_VERSION", "7")
    assert protocol_version() == 7 and not compatible(PROTOCOL_VERSION) and compatible(7)


def test_an_incompatible_peer_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="locomesh.version"):
        for _ in range(5):  # records are read every heartbeat
            assert note_incompatible("12D3KooWonce", "0.1.0", 1) is not None
        note_incompatible("12D3KooWfine", "0.2.5", PROTOCOL_VERSION)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "12D3KooWonce runs locomesh 0.1.0 (protocol 1)" in lines[0], lines


def test_the_peers_warned_about_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ids are free: a flood of incompatible records must not grow the once-only set without end."""
    import protocol.version as version

    monkeypatch.setattr(version, "_warned", {})
    monkeypatch.setattr(version, "MAX_WARNED", 10)
    for i in range(50):
        note_incompatible(f"12D3KooWflood{i}", "0.1.0", 1)
    assert len(version._warned) == 10 and "12D3KooWflood49" in version._warned


def test_a_hello_of_another_protocol_is_refused_with_the_line() -> None:
    async def run() -> None:
        hello = {"protocol": PROTOCOL_VERSION + 1, "version": "9.0.0"}
        stream, sink = canned_stream(_frame("hello", hello) + _frame("state_request", {}), peer="12D3KooWnewer")
        with pytest.raises(IncompatiblePeer, match=rf"runs locomesh 9\.0\.0 \(protocol {PROTOCOL_VERSION + 1}\); this node runs .* upgrade this node"):
            await server_hello(stream, None, STATE, "12D3KooWnewer", "me")
        # the server answered with its own hello first, so the client can name both versions too
        (answer,) = _sent(sink)
        assert answer.kind == "hello" and answer.body["protocol"] == PROTOCOL_VERSION

        stream, _ = canned_stream(_frame("hello", hello_body(None, "server", STATE, "me", "x")), peer="12D3KooWsame")
        await server_hello(stream, None, STATE, "12D3KooWsame", "me")  # the same protocol passes

    asyncio.run(run())


def test_a_client_refuses_a_server_of_another_protocol() -> None:
    async def run() -> None:
        stream, sink = canned_stream(_frame("hello", {"protocol": 1, "version": "0.1.0"}) + _frame("state", {}), peer="12D3KooWold")
        await client_hello(stream, None, STATE, "me", "12D3KooWold")
        assert _sent(sink)[0].body == {"protocol": PROTOCOL_VERSION, "version": hello_body(None, "client", STATE, "me", "x")["version"]}
        with pytest.raises(IncompatiblePeer, match=r"runs locomesh 0\.1\.0 \(protocol 1\).*upgrade that peer"):
            await stream.recv(expect="state")

    asyncio.run(run())


def test_a_peer_older_than_the_hello_is_refused_but_may_ask_for_status() -> None:
    async def run() -> None:
        stream, _ = canned_stream(_frame("state_request", {}), peer="12D3KooWancient")
        with pytest.raises(IncompatiblePeer, match="older .protocol 1, no version hello.: upgrade with `git pull && make setup`"):
            await server_hello(stream, None, STATE, "12D3KooWancient", "me")
        stream, _ = canned_stream(_frame("status_request", {}), peer="12D3KooWancient")
        await server_hello(stream, None, ids.STATUS, "12D3KooWancient", "me")
        assert (await stream.recv(expect="status_request")).kind == "status_request"  # the request is not lost

        # a server older than the hello reads ours as an unknown request: the client names it as protocol 1
        refusal = _frame("error", {"code": "schema", "message": "expected a state_request message, got 'hello'"})
        stream, _ = canned_stream(refusal, peer="12D3KooWancient")
        await client_hello(stream, None, STATE, "me", "12D3KooWancient")
        with pytest.raises(IncompatiblePeer, match=r"\(protocol 1\)"):
            await stream.recv()

    asyncio.run(run())


def test_records_and_round_entries_carry_the_protocol() -> None:
    assert PeerRecord.from_value({"peer_id": "p"}).protocol == 1  # a record from before the field
    assert PeerRecord.from_value(PeerRecord(peer_id="p", protocol=PROTOCOL_VERSION).to_value()).protocol == PROTOCOL_VERSION
    assert RoundEntry(peer_id="p", samples=1, codec="none").protocol == protocol_version()
    assert RoundEntry.from_value({"peer_id": "p", "samples": 1, "codec": "none"}).protocol == 1


def test_node_status_shows_versions_and_flags_outdated_peers() -> None:
    from rich.console import Console

    from node.ops.status import compatibility, status_table

    assert [compatibility(p) for p in (1, PROTOCOL_VERSION, PROTOCOL_VERSION + 1)] == ["outdated", "ok", "newer"]
    row = {"role": "trainer", "device": "cpu", "reachability": "public", "tokens_per_s": 10.0, "round": 3, "inner_step": 4,
           "loss": 2.5, "record_age_s": 1.0, "stage": -1}
    result = {"run_id": "r", "stages": [], "version_hint": "1 peer(s) run another protocol version", "peers": [
        {**row, "peer_id": "12D3KooWcurrent", "version": "0.2.0", "protocol": PROTOCOL_VERSION, "compatibility": "ok"},
        {**row, "peer_id": "12D3KooWstale01", "version": "0.1.0", "protocol": 1, "compatibility": "outdated"}]}
    console = Console(width=200, record=True)
    console.print(status_table(result))
    text = console.export_text()
    assert f"0.2.0 p{PROTOCOL_VERSION}" in text and "0.1.0 p1 outdated" in text and "another protocol version" in text
