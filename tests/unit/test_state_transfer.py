"""State download for joiners: what a joiner already holds is not sent again, and a peer cannot make it
keep tensors it never offered."""

import asyncio

import pytest
import torch

from gossip.state_server import StateServer
from gossip.state_transfer import StateSnapshot, download_state
from protocol.errors import SchemaError
from tests.helpers.memory_transport import MemoryTransport, Network, canned_stream, frames

SHAPES = [(64, 32), (32,), (7, 3)]


async def _serving(states: dict[str, dict[str, list[torch.Tensor]]], fingerprints: dict[str, str], round_no: int,
                   progress: dict[str, int] | None = None) -> Network:
    """A network where each peer of ``states`` serves a snapshot of its state (``progress``: the inner step
    each says it is at, default 3)."""
    network = Network()
    for peer, state in states.items():
        step = (progress or {}).get(peer, 3)
        server = StateServer(network.transport(peer), "run", progress=lambda step=step: step)  # type: ignore[arg-type]
        await server.start()
        server.publish(StateSnapshot(round=round_no, tensors=state, fingerprint=fingerprints[peer], meta={}))
    return network


def _state(seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"params": [torch.randn(s, generator=g) for s in SHAPES], "outer_momentum": [torch.zeros(s) for s in SHAPES]}


def _layout(tensors: dict[str, list[torch.Tensor]]) -> dict[str, list[tuple[tuple[int, ...], torch.dtype]]]:
    return {name: [(tuple(t.shape), t.dtype) for t in ts] for name, ts in tensors.items()}


def _download(served: dict[str, list[torch.Tensor]], held: dict[str, list[torch.Tensor]] | None):
    async def go():
        network = await _serving({"server": served}, {"server": "fp"}, 4)
        got = await download_state(network.transport("joiner"), "server", "run", _layout(served), have=held)  # type: ignore[arg-type]
        await asyncio.gather(*network.tasks)
        return got, network.sent["server"]

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

    liar = MemoryTransport(peer_id="joiner", reply=frames(("state", head), ("end", {})))
    with pytest.raises(SchemaError, match="identical"):
        asyncio.run(download_state(liar, "server", "run", _layout(served)))  # type: ignore[arg-type]


def test_have_must_be_a_map():
    server = StateServer(None, "run", progress=lambda: 0)  # type: ignore[arg-type]
    server.publish(StateSnapshot(round=0, tensors=_state(0), fingerprint="fp", meta={}))

    async def ask() -> None:
        stream, _ = canned_stream(frames(("get_state", {"run_id": "run", "have": [1, 2]})))
        await server._handle(stream)

    with pytest.raises(SchemaError, match="have"):
        asyncio.run(ask())


BIG = [(512, 1024), (1024,), (700, 600), (3, 5)]  # several 1 MiB chunks per tensor


def _big_state(seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"params": [torch.randn(s, generator=g) for s in BIG], "outer_momentum": [torch.randn(s, generator=g) for s in BIG]}


def _striped(states: dict[str, dict[str, list[torch.Tensor]]], down: set[str] = frozenset(),
             progress: dict[str, int] | None = None):
    async def go():
        distinct = len(set(map(id, states.values()))) > 1
        network = await _serving(states, {p: f"fp{id(state)}" if distinct else "fp" for p, state in states.items()}, 7,
                                 progress)
        network.down = set(down)
        first = next(iter(states.values()))
        try:
            return await download_state(network.transport("joiner"), list(states), "run", _layout(first)), network  # type: ignore[arg-type]
        finally:
            await asyncio.gather(*network.tasks, return_exceptions=True)

    return asyncio.run(go())


def test_a_striped_download_takes_an_even_share_from_each_peer():
    state = _big_state(0)
    got, transport = _striped({"a": state, "b": state, "c": state})
    for name, ts in state.items():
        assert all(torch.equal(x, y) for x, y in zip(got.snapshot.tensors[name], ts)), name
    total = sum(_full_bytes(state, n) for n in state)
    shares = [transport.sent[p] for p in "abc"]
    assert sum(shares) < total + 8192
    assert max(shares) <= total / 3 + (1 << 20) + 4096, "no peer sends more than its share and one chunk"


def test_one_stripe_peer_cannot_set_the_progress_a_joiner_resumes_at():
    """Progress into the round is a claim: the median of the stripe peers', not the largest (10⁶ here)."""
    state = _big_state(0)
    got, _ = _striped({"a": state, "b": state, "c": state}, progress={"a": 5, "b": 10**6, "c": 6})
    assert got.inner_step == 6


def test_a_stripe_whose_peer_is_gone_comes_from_another():
    state = _big_state(1)
    got, transport = _striped({"a": state, "b": state, "c": state}, down={"b"})
    assert all(torch.equal(x, y) for x, y in zip(got.snapshot.tensors["params"], state["params"]))
    assert "b" not in transport.sent


def test_peers_with_different_states_are_not_mixed():
    with pytest.raises(SchemaError, match="different states"):
        _striped({"a": _big_state(0), "b": _big_state(2)})


def test_a_stripe_request_out_of_range_is_refused():
    server = StateServer(None, "run", progress=lambda: 0)  # type: ignore[arg-type]
    server.publish(StateSnapshot(round=0, tensors=_state(0), fingerprint="fp", meta={}))

    async def ask(stripe) -> None:
        stream, _ = canned_stream(frames(("get_state", {"run_id": "run", "stripe": stripe})))
        await server._handle(stream)

    for bad in ([2, 2], [0, 99], "0/2", [True, 2]):
        with pytest.raises(SchemaError, match="stripe"):
            asyncio.run(ask(bad))


class _LyingServer(StateServer):
    """Serves poisoned tensors under the header (digests) of an honest state."""

    def __init__(self, *args, honest: dict[str, list[torch.Tensor]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.honest = honest

    async def digests(self, snap):  # type: ignore[override]
        from gossip.state_transfer import group_digests

        return group_digests(self.honest)


def test_one_stripe_peer_cannot_poison_its_share_of_a_download():
    from gossip.state_transfer import PoisonedState

    honest = _state(0)
    poisoned = {name: [t + 1.0 for t in ts] for name, ts in honest.items()}

    async def go():
        network = Network()
        good = StateServer(network.transport("good"), "run", progress=lambda: 3)  # type: ignore[arg-type]
        bad = _LyingServer(network.transport("bad"), "run", progress=lambda: 3, honest=honest)  # type: ignore[arg-type]
        for server, state in ((good, honest), (bad, poisoned)):
            await server.start()
            server.publish(StateSnapshot(round=4, tensors=state, fingerprint="fp", meta={}))
        with pytest.raises(PoisonedState, match="do not match the digests"):
            await download_state(network.transport("joiner"), ["good", "bad"], "run", _layout(honest))  # type: ignore[arg-type]
        alone = await download_state(network.transport("joiner"), "good", "run", _layout(honest))  # type: ignore[arg-type]
        assert all(torch.equal(a, b) for a, b in zip(alone.snapshot.tensors["params"], honest["params"]))

    asyncio.run(go())


def test_a_state_other_than_the_majoritys_is_refused():
    from gossip.state_transfer import PoisonedState, group_digests, majority_state, state_headers

    honest, other = _state(0), _state(1)

    async def go():
        network = await _serving({"a": honest, "b": honest, "c": other}, {"a": "fp", "b": "fp", "c": "fq"}, 4)
        headers = await state_headers(network.transport("joiner"), ["a", "b", "c"], "run", _layout(honest))  # type: ignore[arg-type]
        assert set(headers) == {"a", "b", "c"} and network.sent["c"] < 4096, "a header costs a peer one frame"
        round_no, trusted, holders = majority_state(headers)
        assert (round_no, trusted, holders) == (4, group_digests(honest), ["a", "b"])
        with pytest.raises(PoisonedState, match="other than the one most peers hold"):
            await download_state(network.transport("joiner"), "c", "run", _layout(honest), trusted=trusted)  # type: ignore[arg-type]

    asyncio.run(go())


def test_without_a_strict_majority_nobody_is_trusted():
    from gossip.state_transfer import majority_state

    one, two = {"params": "aa"}, {"params": "bb"}
    assert majority_state({}) is None
    assert majority_state({"a": (3, one)}) == (3, one, ["a"])
    assert majority_state({"a": (3, one), "b": (3, two)}) is None  # a tie: no peer id decides
    assert majority_state({"a": (3, one), "b": (3, one), "c": (3, two)}) == (3, one, ["a", "b"])
    assert majority_state({"a": (3, one), "b": (4, one)}) is None  # rounds differ: two states


def test_an_offered_state_is_copied_once_on_the_first_request_and_withdrawn_before_it_changes():
    """A replica offers its state after each round instead of copying it: the copy (φ and momentum, twice the
    model) is made on a joiner's first request and served to the next. The outer optimizer withdraws the
    offer before its step changes φ: an offer nobody asked for is never built (joiners hear there is none
    yet), one that was built stays served as it was."""
    from gossip.outer import NesterovOuter

    live = _state(0)
    outer = NesterovOuter(lr=1.0, momentum=0.0)
    builds = []

    def build():
        builds.append(1)
        return StateSnapshot(round=4, tensors={n: [t.clone() for t in ts] for n, ts in live.items()}, fingerprint="fp", meta={})

    async def go():
        network = Network()
        server = StateServer(network.transport("server"), "run", progress=lambda: 0)  # type: ignore[arg-type]
        outer.before_change = server.withdraw
        await server.start()
        fetch = lambda: download_state(network.transport("joiner"), "server", "run", _layout(live))  # noqa: E731
        step = lambda: outer.step(live["params"], [-torch.ones_like(t) for t in live["params"]])  # noqa: E731  (φ += 1)
        server.offer(build)
        assert builds == [], "nothing is copied until a joiner asks"
        first, second = await fetch(), await fetch()
        assert len(builds) == 1 and all(torch.equal(a, b) for a, b in zip(second.snapshot.tensors["params"], live["params"]))
        step()  # the next round's outer step
        kept = await fetch()
        assert all(torch.allclose(a, b - 1.0, atol=1e-6) for a, b in zip(kept.snapshot.tensors["params"], live["params"])), "the copy, as it was"
        server.offer(build)
        step()
        with pytest.raises(Exception, match="no state to share yet"):
            await fetch()
        assert len(builds) == 1, "an offer withdrawn unasked was never copied"
        await asyncio.gather(*network.tasks, return_exceptions=True)

    asyncio.run(go())


def test_withdrawing_waits_for_a_copy_under_way():
    """A joiner's request copies the state in a worker thread; the round that is about to change it waits
    until the copy is done, so no joiner gets a state torn between two rounds."""
    import threading
    import time

    started, copied = threading.Event(), []

    def slow_build():
        started.set()
        time.sleep(0.3)
        copied.append(time.monotonic())
        return StateSnapshot(round=1, tensors=_state(0), fingerprint="fp", meta={})

    server = StateServer(MemoryTransport(), "run", progress=lambda: 0)  # type: ignore[arg-type]
    server.offer(slow_build)
    builder = threading.Thread(target=server._built)
    builder.start()
    assert started.wait(5)
    server.withdraw()
    withdrawn = time.monotonic()
    builder.join()
    assert copied and withdrawn >= copied[0] and server.snapshot is not None
