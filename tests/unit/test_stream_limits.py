"""One peer cannot hold every serving slot of a node: streams per (protocol, client) are capped."""

import asyncio

from protocol import ids
from protocol.auth import hello_body
from protocol.frames import decode_message, encode_frame, encode_message, read_frame
from protocol.hivemind_transport import MAX_RELAYED_STREAMS, MAX_STREAMS_PER_PEER, REQUEST_RATES, Transport
from tests.helpers.memory_transport import canned_stream, ended_reader


HELLO = encode_frame(encode_message("hello", hello_body(None, "client", ids.STATE, "c", "server")))  # every stream opens with one


class _P2P:
    class peer_id:  # noqa: N801 - the shape hivemind's P2P has
        @staticmethod
        def to_base58() -> str:
            return "server"


def test_a_client_is_refused_past_its_stream_cap_and_others_are_not() -> None:
    errors: list[tuple[str, str, str]] = []
    transport = Transport(_P2P(), on_error=lambda *e: errors.append(e))  # type: ignore[arg-type]

    async def run() -> tuple[list[str], bool]:
        release = asyncio.Event()

        async def slow(stream) -> None:
            await release.wait()

        held = [asyncio.ensure_future(transport.handle(ids.AVERAGE, slow, canned_stream(HELLO)[0], "greedy"))
                for _ in range(MAX_STREAMS_PER_PEER)]
        await asyncio.sleep(0.05)
        refused, sink = canned_stream(HELLO)
        await transport.handle(ids.AVERAGE, slow, refused, "greedy")
        frame = await read_frame(ended_reader(bytes(sink.data)))  # refused before the hello is read
        other = asyncio.ensure_future(transport.handle(ids.AVERAGE, slow, canned_stream(HELLO)[0], "someone-else"))
        await asyncio.sleep(0.05)
        served_other = not other.done()
        release.set()
        await asyncio.gather(*held, other)
        return [decode_message(frame).body["code"]], served_other

    codes, served_other = asyncio.run(run())
    assert codes == ["busy"] and served_other
    assert errors == [(ids.AVERAGE, "busy", "greedy")]
    assert transport._active == {}


def test_a_relay_carrying_many_clients_is_capped_far_above_one_client() -> None:
    """A relay's ``relayed`` streams carry many clients' requests (each capped again under its origin), so it
    holds up to MAX_RELAYED_STREAMS; past that it is refused (it was never capped: any peer could open them)."""
    transport = Transport(_P2P())  # type: ignore[arg-type]

    async def run() -> tuple[int, str]:
        release = asyncio.Event()

        async def slow(stream) -> None:
            await release.wait()

        held = [asyncio.ensure_future(transport.handle(ids.RELAYED, slow, canned_stream(HELLO)[0], "the-relay"))
                for _ in range(MAX_RELAYED_STREAMS)]
        await asyncio.sleep(0.05)
        open_now = transport._active[(ids.RELAYED, "the-relay")]
        refused, sink = canned_stream(HELLO)
        await transport.handle(ids.RELAYED, slow, refused, "the-relay")
        release.set()
        await asyncio.gather(*held)
        return open_now, decode_message(await read_frame(ended_reader(bytes(sink.data)))).body["code"]

    open_now, code = asyncio.run(run())
    assert open_now == MAX_RELAYED_STREAMS > MAX_STREAMS_PER_PEER and code == "busy"


def test_only_this_nodes_own_relays_may_carry_relayed_streams_to_it() -> None:
    """Any connected peer could open ``relayed`` streams naming a fresh origin each (no per-client limit
    binds then): a node takes them only from the relays that hold its reservations."""
    from protocol.errors import SchemaError
    from protocol.relay import serve_relayed

    transport = Transport(_P2P())  # type: ignore[arg-type]
    transport.own_relays = lambda: {"my-relay"}
    relayed = encode_frame(encode_message("relayed", {"from": "origin", "protocol": ids.STATE}))

    async def run(carrier: str) -> str:
        stream, _ = canned_stream(relayed, peer=carrier)
        try:
            await serve_relayed(transport, stream)
        except SchemaError as e:
            return str(e)
        except Exception as e:  # past the check: the (absent) handler or handshake fails
            return type(e).__name__
        return "served"

    assert "not a relay of this node" in asyncio.run(run("stranger"))
    assert "not a relay of this node" not in asyncio.run(run("my-relay"))


def test_state_requests_are_rate_limited_per_client() -> None:
    """A 30-byte get_state costs a whole state: past its burst a client gets one every 2 s, others are unaffected."""
    errors: list[tuple[str, str, str]] = []
    transport = Transport(_P2P(), on_error=lambda *e: errors.append(e))  # type: ignore[arg-type]
    burst, rate = REQUEST_RATES[ids.STATE]
    served: list[str] = []

    async def answer(stream) -> None:
        served.append(stream.peer)

    async def ask(client: str) -> str:
        stream, sink = canned_stream(HELLO, peer=client)
        await transport.handle(ids.STATE, answer, stream, client)
        frames = ended_reader(bytes(sink.data))
        first = decode_message(await read_frame(frames))
        return first.body.get("code", "") if first.kind == "error" else first.kind

    async def run() -> tuple[list[str], str, str]:
        replies = [await ask("greedy") for _ in range(burst + 1)]
        other = await ask("someone-else")
        tokens, when = transport._requests[(ids.STATE, "greedy")]
        transport._requests[(ids.STATE, "greedy")] = (tokens, when - 1.1 / rate)  # a little over one refill later
        return replies, other, await ask("greedy")

    replies, other, later = asyncio.run(run())
    assert replies == ["hello"] * burst + ["busy"] and other == "hello" and later == "hello"
    assert served.count("greedy") == burst + 1 and errors == [(ids.STATE, "busy", "greedy")]
    assert REQUEST_RATES[ids.STATE][0] >= 20  # a resync's 20 tries at one peer still pass


def test_a_client_refused_again_and_again_gets_one_log_line_a_minute_and_others_their_own() -> None:
    """40 relayed streams to every member each round once wrote 40 warnings a round: the refusals are still
    answered and counted, but each (protocol, client) gets one line a minute, which says how many more there were."""
    import logging

    from protocol.refusal_log import RefusalLog

    lines: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("test-refusal-log")
    logger.addHandler(Sink())
    now = [0.0]
    log = RefusalLog(logger, interval=60.0, max_keys=4, clock=lambda: now[0])
    assert [log.refused(ids.RELAYED, "flooder", "not a relay") for _ in range(100)].count(True) == 1
    assert log.refused(ids.RELAYED, "someone-else", "not a relay") and log.refused(ids.STATE, "flooder", "busy")
    now[0] = 61.0
    assert log.refused(ids.RELAYED, "flooder", "not a relay")
    assert lines[-1].endswith("(99 more of its /locomesh/relayed/1.0 requests refused since the last line)"), lines[-1]
    assert len(lines) == 4
    for i in range(10):  # memory stays bounded by max_keys
        log.refused(ids.STATE, f"client-{i}", "busy")
    assert len(log._seen) <= 4


def test_a_transport_answers_every_refusal_but_logs_a_clients_first_one_only(caplog) -> None:
    from protocol.errors import SchemaError

    errors: list[tuple[str, str, str]] = []
    transport = Transport(_P2P(), on_error=lambda *e: errors.append(e))  # type: ignore[arg-type]

    async def refuse(stream) -> None:
        raise SchemaError("flooder is not a relay of this node")

    async def run() -> list[str]:
        codes = []
        for _ in range(5):
            stream, sink = canned_stream(HELLO)
            await transport.handle(ids.RELAYED, refuse, stream, "flooder")
            frames = ended_reader(bytes(sink.data))
            await read_frame(frames)  # the server's hello
            codes.append(decode_message(await read_frame(frames)).body["code"])
        return codes

    with caplog.at_level("WARNING", logger="protocol.hivemind_transport"):
        codes = asyncio.run(run())
    assert codes == ["schema"] * 5 and len(errors) == 5
    assert [r.getMessage() for r in caplog.records].count(
        f"refused {ids.RELAYED} request from flooder: flooder is not a relay of this node") == 1
