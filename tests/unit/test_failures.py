"""A fetch's failure is labelled by whose fault it is; a bug in this node is ``internal``, with one traceback."""

import asyncio
import logging

import pytest
import torch

from gossip.exchange import Contribution, RoundExchange
from gossip.failures import failure_reason
from protocol.errors import SchemaError
from tests.helpers.memory_transport import MemoryTransport


def test_labels() -> None:
    assert failure_reason(asyncio.TimeoutError(), "x") == "timeout"
    assert failure_reason(ConnectionResetError(), "x") == "connection"
    assert failure_reason(EOFError(), "x") == "connection"
    assert failure_reason(SchemaError("bad"), "x") == "schema"


def test_a_programming_error_is_internal_and_logged_once_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        {}["missing"]

    caplog.set_level(logging.WARNING, logger="gossip.failures")
    for _ in range(3):
        try:
            broken()
        except KeyError as e:
            assert failure_reason(e, "decoding a test payload") == "internal"
    warnings = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].exc_info is not None and "decoding a test payload" in warnings[0].getMessage()


def test_gather_counts_a_bug_while_fetching_as_internal_not_connection() -> None:
    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(4,)])  # type: ignore[arg-type]

    async def buggy_fetch(peer, round_no, parts=None):
        raise TypeError("unsupported operand")

    exchange.fetch = buggy_fetch  # type: ignore[method-assign]
    got, failed = asyncio.run(exchange.gather(["peer-a"], 0, timeout=1.0))
    assert not got and failed == {"peer-a": "internal"}


async def _fetch(exchange: RoundExchange, round_no: int, peer: str, wire: str = "none") -> str:
    """What ``exchange`` answers ``peer``'s fetch of ``round_no``: "served", or why it refused."""
    from protocol.errors import SchemaError
    from protocol.frames import encode_frame, encode_message
    from tests.helpers.memory_transport import canned_stream

    stream, _ = canned_stream(encode_frame(encode_message("fetch", {"run_id": "run", "round": round_no, "codec": wire})),
                              peer=peer)
    try:
        await exchange._handle(stream)
    except SchemaError as e:
        return str(e)
    return "served"


def test_requests_for_rounds_never_published_leave_no_bookkeeping_behind() -> None:
    """A request may name any round: the rounds awaited are capped and forgotten when nobody publishes them."""
    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(4,)], serve_timeout=0.2)  # type: ignore[arg-type]

    async def flood() -> list[str]:
        return await asyncio.gather(*(_fetch(exchange, 10**6 + i, f"peer{i}") for i in range(100)))

    answers = asyncio.run(flood())
    assert sum("too many rounds awaited" in a for a in answers) == 100 - 16
    assert sum("no contribution for round" in a for a in answers) == 16
    assert exchange._ready == {} and exchange._waits.waiting == {} and not exchange._waits.clients


def test_one_client_asking_for_many_future_rounds_leaves_room_for_the_others() -> None:
    """One client used to fill the 16 awaited rounds itself, and every member's fetch of the next round was
    refused (the members fell back to fetching parts directly): now a client waits for 8 rounds at most."""
    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(4,)], serve_timeout=0.5)  # type: ignore[arg-type]

    async def publish_soon() -> None:
        await asyncio.sleep(0.2)
        blobs, _ = exchange.encode(0, [torch.zeros(4)])
        exchange.publish(Contribution(0, 1, "fp", exchange.wire_of(0), blobs))

    async def attack() -> list[str]:
        *answers, _ = await asyncio.gather(*(_fetch(exchange, 10**6 + i, "attacker") for i in range(16)),
                                           _fetch(exchange, 0, "member"), publish_soon())
        return answers

    answers = asyncio.run(attack())
    assert answers[-1] == "served", answers[-1]
    assert sum("already wait" in a for a in answers[:16]) == 8


def test_a_grouped_request_that_arrives_before_this_member_grouped_is_served_once_it_has() -> None:
    """A member that found its group first asks with the group's wire tag before this one set it: the request
    is judged once this member publishes the round (under load it was refused, and the asker averaged without
    it), while a wire that still differs then is refused."""
    from protocol.errors import SchemaError
    from protocol.frames import encode_frame, encode_message
    from tests.helpers.memory_transport import canned_stream

    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(4,)], serve_timeout=5.0)  # type: ignore[arg-type]

    async def ask(wire: str) -> str:
        stream, _ = canned_stream(encode_frame(encode_message("fetch", {"run_id": "run", "round": 0, "codec": wire})))
        try:
            await exchange._handle(stream)
        except SchemaError as e:
            return str(e)
        return "served"

    async def group_then_publish() -> None:
        await asyncio.sleep(0.2)
        exchange.regroup(0, exchange.layout(0), "g0of2")
        blobs, _ = exchange.encode(0, [torch.zeros(4)])
        exchange.publish(Contribution(0, 1, "fp", exchange.wire_of(0), blobs))

    async def race() -> list[str]:
        *answers, _ = await asyncio.gather(ask("none|g0of2"), ask("q8|g0of2"), group_then_publish())
        return answers

    served, refused = asyncio.run(race())
    assert served == "served"
    assert "wire mismatch" in refused


def test_a_peer_outside_the_group_a_round_closed_with_is_refused_the_contribution() -> None:
    """A member that registered after this node's rendezvous closed must not average with this node's update
    while this node averaged without its (seen live: a joiner's first round named 3 contributors where the
    first node's named itself alone); a member of the group is still served."""
    from protocol.frames import encode_frame, encode_message
    from tests.helpers.memory_transport import canned_stream

    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(4,)], serve_timeout=5.0)  # type: ignore[arg-type]
    blobs, _ = exchange.encode(0, [torch.zeros(4)])
    exchange.publish(Contribution(0, 1, "fp", exchange.wire_of(0), blobs))

    async def ask(peer: str) -> str:
        stream, _ = canned_stream(encode_frame(encode_message("fetch", {"run_id": "run", "round": 0, "codec": "none"})), peer=peer)
        try:
            await exchange._handle(stream)
        except SchemaError as e:
            return str(e)
        return "served"

    assert asyncio.run(ask("late")) == "served"  # before the rendezvous closed: any member may ask
    exchange.close_group(0, {"self", "member"})
    assert asyncio.run(ask("member")) == "served"
    assert "closed without late" in asyncio.run(ask("late"))


def test_a_node_serves_its_last_two_rounds_and_keeps_only_their_wire_parts() -> None:
    """A dense round's parts are the whole payload, so each round kept to serve costs its size: a node keeps
    its latest round and the one before (for a member that finished that rendezvous later), without the
    decoded values (a lossy codec's are a float32 copy of the model), and refuses older rounds."""
    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "q8", [(4096,)])  # type: ignore[arg-type]

    async def serve_three_rounds() -> list[str]:
        for r in range(3):
            blobs, decoded = exchange.encode(r, [torch.randn(4096)])
            mine = Contribution(r, 1, "fp", exchange.wire_of(r), blobs, "me", decoded)
            exchange.publish(mine)
            assert len(mine.decoded) == 1  # the caller's round still holds its own decoded values
        assert all(not c.decoded for c in exchange._contributions.values())
        return [await _fetch(exchange, r, "peer", "q8") for r in range(3)]

    assert [("over" in a) for a in asyncio.run(serve_three_rounds())] == [True, False, False]


def test_a_past_round_every_member_downloaded_is_released_and_one_still_owed_is_kept() -> None:
    """A past round's parts (a dense round: the model's size) were kept two rounds whoever still needed them:
    once every other member of its closed group has downloaded it whole, nobody may ask again."""
    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(4,)])  # type: ignore[arg-type]
    me = exchange.transport.peer_id

    def publish(r: int) -> None:
        blobs, _ = exchange.encode(r, [torch.zeros(4)])
        exchange.publish(Contribution(r, 1, "fp", exchange.wire_of(r), blobs))

    async def rounds() -> None:
        publish(0)
        exchange.close_group(0, {me, "a", "b"})
        assert await _fetch(exchange, 0, "a") == "served"
        publish(1)
        exchange.close_group(1, {me, "a"})
        assert 0 in exchange._contributions  # "b" has not downloaded round 0 yet
        assert await _fetch(exchange, 0, "b") == "served"
        assert 0 not in exchange._contributions  # every member has it: released at once
        assert await _fetch(exchange, 1, "a") == "served"
        assert 1 in exchange._contributions  # the latest round stays until the next is published
        publish(2)
        assert 1 not in exchange._contributions and 2 in exchange._contributions
        publish(3)  # round 0's bookkeeping (released early) goes with its age
        assert 0 not in exchange._ready and 0 not in exchange._groups and 0 not in exchange._served

    asyncio.run(rounds())


def test_one_member_asking_for_a_round_again_and_again_receives_it_twice_at_most() -> None:
    """A member asking for the next rounds at each of its rounds (the ``future`` attack) held many requests
    for one round, and every one was answered when it was published: each honest member sent about 6 × its
    payload a round instead of 1.3 ×. Now one client receives at most 2× a round's bytes; others are
    served as before."""
    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(1024,), (1024,)], serve_timeout=5.0)  # type: ignore[arg-type]

    async def publish_soon() -> None:
        await asyncio.sleep(0.2)
        blobs, _ = exchange.encode(0, [torch.zeros(1024), torch.ones(1024)])
        exchange.publish(Contribution(0, 1, "fp", exchange.wire_of(0), blobs))

    async def flood() -> tuple[list[str], str]:
        *answers, _ = await asyncio.gather(*(_fetch(exchange, 0, "asker") for _ in range(10)), publish_soon())
        return answers, await _fetch(exchange, 0, "member")

    answers, member = asyncio.run(flood())
    assert answers.count("served") == 2, answers
    assert all("may receive 2×" in a for a in answers if a != "served")
    assert member == "served"
    assert "may receive 2×" in asyncio.run(_fetch(exchange, 0, "asker"))  # later requests too


def test_a_request_for_some_parts_spends_their_bytes_and_a_broken_stream_gives_back_what_it_did_not_send() -> None:
    """Reduce-scatter asks for a few parts, then those parts again when an owner fails; a stream that broke
    half-way counts only what went out, so a member on a flaky link may fetch again."""
    from protocol.frames import FramedStream, encode_frame, encode_message
    from tests.helpers.memory_transport import Sink, ended_reader

    exchange = RoundExchange(MemoryTransport(reply=b""), "run", "none", [(1024,)] * 4)  # type: ignore[arg-type]
    blobs, _ = exchange.encode(0, [torch.zeros(1024)] * 4)
    exchange.publish(Contribution(0, 1, "fp", exchange.wire_of(0), blobs))
    whole = sum(len(b) for b in blobs)

    async def ask(parts: list[int] | None, breaks_after: int | None = None) -> str:
        request = {"run_id": "run", "round": 0, "codec": "none", **({"parts": parts} if parts is not None else {})}
        stream = FramedStream(ended_reader(encode_frame(encode_message("fetch", request))), Sink(breaks_after), peer="member")  # type: ignore[arg-type]
        try:
            await exchange._handle(stream)
        except (SchemaError, ConnectionError) as e:
            return f"{type(e).__name__}: {e}"
        return "served"

    assert asyncio.run(ask([0])) == "served"
    assert exchange._budget.sent[("contribution", 0)]["member"] == len(blobs[0])
    assert asyncio.run(ask(None, breaks_after=len(blobs[0]) * 3 // 2)).startswith("ConnectionResetError")  # one part went out
    assert exchange._budget.sent[("contribution", 0)]["member"] == 2 * len(blobs[0])
    assert asyncio.run(ask(None)) == "served"
    assert exchange._budget.sent[("contribution", 0)]["member"] == whole + 2 * len(blobs[0])
    assert asyncio.run(ask([1, 2])) == "served"  # still within 2× the round
    assert "may receive 2×" in asyncio.run(ask([3]))


def test_a_refusal_because_the_group_closed_is_labelled_late() -> None:
    """The label a late member's round reads (gossip.late_round); any other refusal stays ``remote``."""
    from gossip.failures import LATE, failure_reason
    from protocol.errors import GroupClosed, RemoteError

    assert failure_reason(RemoteError(GroupClosed.code, "closed without you"), "fetching") == LATE
    assert failure_reason(RemoteError("schema", "round 3 is over"), "fetching") == "remote"


def test_a_late_member_follows_only_a_strict_majority_of_refusals() -> None:
    """One liar's refusal among members that served cannot make a member drop out of a round."""
    from gossip.late_round import closed_without_me

    assert closed_without_me(["a", "b"], {"a": "late", "b": "late"}) == ["a", "b"]
    assert closed_without_me(["a"], {"a": "late"}) == ["a"]
    assert closed_without_me(["a", "b", "c"], {"a": "late", "c": "late"}) == ["a", "c"]  # b, late too, served it
    assert closed_without_me(["a", "b"], {"a": "late"}) == []  # b served it: the round goes on with b
    assert closed_without_me(["a", "b", "c"], {"a": "late", "b": "timeout"}) == []
    assert closed_without_me([], {}) == []
