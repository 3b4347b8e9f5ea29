"""Hostile and broken peers against real daemons: malformed streams, other runs, private swarms,
poisoned updates. The node refuses with typed errors, counts them, and keeps training and serving."""

import asyncio
import struct
import time
from urllib.request import urlopen

import msgpack
import pytest
import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from compression import get_codec
from gossip.exchange import Contribution, RoundExchange
from gossip.rendezvous import gather_group, list_peers, publish_peer
from swarm.models.presets import GPT, preset
from node.replica.rounds import RoundPlan
from node.runtime.status_service import fetch_status
from protocol import RemoteError, encode_frame, encode_message, ids
from protocol.auth import hello_body
from protocol.errors import SchemaError
from protocol.hivemind_transport import Transport
from protocol.peer_identity import identified_p2p
from protocol.records import PeerRecord, RoundEntry
from tests.helpers.memory_transport import MemoryTransport, frames
from tests.helpers.swarm_utils import FAST_ARGS, start_node


async def _client(boot: str, swarm_key: bytes | None = None) -> tuple[P2P, Transport]:
    p2p = await P2P.create(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    return p2p, Transport(p2p, swarm_key=swarm_key)


async def _raw_exchange(transport: Transport, peer: str, protocol: str, raw: bytes) -> bytes:
    """Send raw bytes on a fresh stream and return the node's first answer frame (it waits for us to close)."""
    _, reader, writer = await transport.p2p.call_binary_stream_handler(__import__("hivemind").p2p.PeerID.from_base58(peer), protocol)
    writer.write(raw)
    await writer.drain()
    while True:  # the node's answer to our hello, if we sent one, comes first
        header = await asyncio.wait_for(reader.readexactly(4), timeout=30)
        data = header + await asyncio.wait_for(reader.readexactly(struct.unpack(">I", header)[0]), timeout=30)
        if msgpack.unpackb(data[4:])["k"] != "hello":
            break
    writer.close()
    return data


HELLO = frames(("hello", hello_body(None, "client", "", "", "")))  # every stream opens with one (protocol.auth)


def _error_code(reply: bytes) -> str:
    length = struct.unpack(">I", reply[:4])[0]
    msg = msgpack.unpackb(reply[4 : 4 + length])
    assert msg["k"] == "error", msg
    return msg["b"]["code"]


def _metric(port: int, name: str) -> float:
    text = urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_malformed_streams_are_refused_and_the_node_keeps_serving(tmp_path, nodes):
    node = start_node(tmp_path, "n", FAST_ARGS + ["--stream-timeout", "3"])
    nodes.append(node)
    boot = node.multiaddr()
    peer = node.info()["peer_id"]
    cases = [
        (ids.STATUS, b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", "malformed"),
        (ids.STATE, struct.pack(">I", 2**31) + b"x" * 64, "frame_too_large"),
        (ids.STATE, encode_frame(encode_message("get_state", {"run_id": "locomesh-demo"}, version=(9, 0))), "version"),
        (ids.STATE, HELLO + frames(("get_state", {"run_id": "someone-elses-run"})), "schema"),
        (ids.AVERAGE, HELLO + frames(("fetch", {"run_id": "locomesh-demo", "round": 0, "codec": "q2"})), "schema"),
        (ids.AVERAGE, HELLO + frames(("fetch", {"run_id": "locomesh-demo", "round": "zero", "codec": "none"})), "schema"),
        (ids.AVERAGE, HELLO + frames(("get_state", {})), "schema"),
        (ids.STATUS, b"\x00\x00\x00\x10abc", "timeout"),  # stalls mid-frame (slow loris)
        (ids.AVERAGE, frames(("fetch", {"run_id": "locomesh-demo", "round": 0, "codec": "none"})), "version"),  # no hello: older
    ]

    async def go():
        p2p, transport = await _client(boot)
        try:
            codes = [(_error_code(await _raw_exchange(transport, peer, proto, raw)), want) for proto, raw, want in cases]
            status = await fetch_status(transport, peer)
            return codes, status
        finally:
            await p2p.shutdown()

    before_steps = node.info()["steps"]
    codes, status = asyncio.run(go())
    for got, want in codes:
        assert got == want
    assert status["peer_id"] == peer and status["state"] == "training"
    for kind in ("malformed", "frame_too_large", "version", "schema", "timeout"):
        assert _metric(node.metrics_port, f'locomesh_errors_total{{kind="{kind}"}}') >= 1, kind
    node.wait(lambda i: i["steps"] > before_steps + 15, 60, "training to go on")
    assert "Traceback" not in node.log()
    assert node.stop() == 0


async def _records_of_a_keyless_stranger(boot: str, member: str, key: bytes) -> bool:
    """A stranger without the swarm key writes a well-signed record of itself into the private swarm's DHT
    (through the member's DHT node): the member refuses to store it, and a reader holding the key sees the
    member only. True when both hold."""
    p2p, validator = await identified_p2p(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    reader_p2p, reader_validator = await identified_p2p(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    reader_validator.swarm_key = key
    try:
        dht = await DHTNode.create(p2p=p2p, initial_peers=[boot], record_validator=validator, client_mode=True)
        reader = await DHTNode.create(p2p=reader_p2p, initial_peers=[boot], record_validator=reader_validator, client_mode=True)
        stranger = p2p.peer_id.to_base58()
        stored = await publish_peer(dht, validator, "locomesh-demo", PeerRecord(peer_id=stranger, round=10**6), 8)
        seen = await list_peers(reader, "locomesh-demo")
        await asyncio.gather(dht.shutdown(), reader.shutdown())
        assert not stored, "the member stored a record without the swarm key's proof"
        assert set(seen) == {member}, seen
        return True
    finally:
        await asyncio.gather(p2p.shutdown(), reader_p2p.shutdown())


def test_private_swarm_refuses_peers_without_the_key(tmp_path, nodes):
    key_file = tmp_path / "swarm.key"
    key_file.write_text("ab" * 32)
    node = start_node(tmp_path, "n", FAST_ARGS + ["--swarm-key", str(key_file)])
    nodes.append(node)
    boot = node.multiaddr()
    peer = node.info()["peer_id"]

    async def ask(key):
        p2p, transport = await _client(boot, swarm_key=key)
        try:
            return await fetch_status(transport, peer)
        finally:
            await p2p.shutdown()

    async def ask_wrong_key(times: int) -> list[str]:
        """What the node answers each of ``times`` requests made with a wrong key (one client)."""
        p2p, transport = await _client(boot, swarm_key=b"x" * 32)
        answers = []
        try:
            for _ in range(times):
                try:
                    await fetch_status(transport, peer)
                    answers.append("accepted")
                except RemoteError as e:
                    answers.append(e.remote_code)
                except Exception as e:  # a lost refusal shows up as a bare broken stream
                    answers.append(f"{type(e).__name__}: {e}")
        finally:
            await p2p.shutdown()
        return answers

    assert asyncio.run(ask(bytes.fromhex("ab" * 32)))["peer_id"] == peer
    with pytest.raises(RemoteError) as e:
        asyncio.run(ask(None))
    assert e.value.remote_code == "auth"  # no hello at all: refused as a private swarm
    answers = asyncio.run(ask_wrong_key(20))
    assert answers == ["auth"] * 20, answers  # the refusal reaches a daemon every time, not only now and then
    assert _metric(node.metrics_port, 'locomesh_errors_total{kind="auth"}') >= 1
    assert asyncio.run(_records_of_a_keyless_stranger(boot, peer, key=bytes.fromhex("ab" * 32)))

    # a daemon without the key is refused by every peer and says what to do
    outsider = start_node(tmp_path, "outsider", FAST_ARGS + ["--max-steps", "5"], [boot])
    nodes.append(outsider)
    assert outsider.process.wait(timeout=180) == 3
    assert "private swarm" in outsider.log() and "--swarm-key" in outsider.log()
    assert outsider.info()["joined_round"] is None
    assert node.stop() == 0


def test_nan_contributions_are_rejected_before_they_touch_the_model():
    transport = MemoryTransport(peer_id="fuzzer-self", reply=b"")
    shapes = [(4, 4)]
    exchange = RoundExchange(transport, "run", "none", shapes)
    blobs, decoded = exchange.encode(0, [torch.full((4, 4), 1.5)])
    poisoned = blobs[0].replace(struct.pack("<f", 1.5), struct.pack("<f", float("nan")))
    assert poisoned != blobs[0]
    exchange.publish(Contribution(0, 8, "fp", "none", [poisoned], "me", decoded))

    async def go():
        stream_reply = frames(("contribution", {"round": 0, "samples": 8, "fingerprint": "fp", "codec": "none", "parts": 1}),
                               ("part", {"i": 0, "payload": poisoned}))
        transport.reply = stream_reply
        await exchange.fetch("evil", 0)

    with pytest.raises(SchemaError, match="NaN"):
        asyncio.run(go())


async def _attacker(boot: str, run_id: str, rounds: int, scales: list[float], log: list) -> None:
    """A peer that joins the run's rendezvous and serves scaled copies of an honest update."""
    p2p, validator = await identified_p2p(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht = await DHTNode.create(p2p=p2p, initial_peers=[boot], record_validator=validator)
    transport = Transport(p2p)
    me = transport.peer_id

    async def status(stream) -> None:  # members wait only for peers that answer (gossip.reachable.Reachable)
        await stream.recv(expect="get_status")
        await stream.send("status", {})

    await transport.serve(ids.STATUS, status)
    model = GPT(preset("nano"))
    shapes = [tuple(p.shape) for p in model.parameters()]
    plan = RoundPlan(names=[n for n, _ in model.named_parameters()], shapes=shapes, codec="none", feedback_decay=0.0, fragments=1,
                     noloco=False)
    wire = plan.wire()  # the honest nodes' (a small model's dense parts are flat runs: "none|flat")
    exchange = RoundExchange(transport, run_id, wire, plan.layout, serve_timeout=60)
    await exchange.start()
    try:
        peers = await list_peers(dht, run_id)
        honest = sorted(peers)[0]
        r = max(rec.round for rec in peers.values()) + 1
        for i in range(rounds):
            await publish_peer(dht, validator, run_id, PeerRecord(peer_id=me, round=r, device="cpu", model="nano"), 30)
            try:
                good = await asyncio.wait_for(exchange.fetch(honest, r), 120)
            except RemoteError:  # asked after the honest node's rendezvous closed without it: try the next round
                r += 1
                continue
            scale = scales[i % len(scales)]
            evil = [t * scale for t in good.decoded]
            blobs = [get_codec("none").encode(t).to_bytes() for t in evil]
            exchange.publish(Contribution(r, good.samples, good.fingerprint, wire, blobs, me, evil))
            entry = RoundEntry(peer_id=me, samples=good.samples, codec=wire)

            async def nobody() -> set:
                return set()

            await gather_group(dht, validator, run_id, r, entry, nobody, timeout=1)
            log.append({"round": r, "scale": scale, "peer": me})
            r += 1
        await asyncio.sleep(5)  # let the honest nodes finish fetching the last poisoned round
    finally:
        await dht.shutdown()
        await p2p.shutdown()


def test_poisoned_updates_do_not_move_the_model_more_than_an_honest_peer(tmp_path, nodes):
    # the aggregation's own bounds: the contribution screen, which would drop both updates first, is off
    args = FAST_ARGS + ["--aggregate", "median-clip", "--averaging-timeout", "30", "--contribution-scores", "off"]
    a = start_node(tmp_path, "a", args + ["--seed", "1"])
    nodes.append(a)
    boot = a.multiaddr()
    b = start_node(tmp_path, "b", args + ["--seed", "2"], [boot])
    nodes.append(b)
    a.wait(lambda i: i.get("outer_rounds", 0) >= 2, 240, "2 rounds")
    b.wait(lambda i: i.get("outer_rounds", 0) >= 1, 240, "1 round")
    log: list = []
    asyncio.run(_attacker(boot, "locomesh-demo", rounds=4, scales=[1000.0, 50.0], log=log))
    time.sleep(2)
    for handle in (a, b):
        assert handle.stop() == 0
    evil = log[0]["peer"][-8:]
    checked = {1000.0: 0, 50.0: 0}
    for handle in (a, b):
        rounds = {r["round"]: r for r in handle.info()["rounds"]}
        for entry in log:
            rec = rounds.get(entry["round"])
            if rec is None or evil not in rec["norms"]:
                continue  # the attacker missed this round's rendezvous
            honest = [n for p, n in rec["norms"].items() if p != evil]
            if entry["scale"] == 1000.0:
                assert any(k.endswith(evil) and v == "norm_outlier" for k, v in rec["failures"].items()), rec
            else:  # clipped and used, not dropped (an honest member may miss the round for its own reasons)
                assert not any(k.endswith(evil) for k in rec["failures"]), rec
                assert rec["contributors"] == len(rec["norms"]) - sum(1 for k in rec["failures"] if k[-8:] in rec["norms"]), rec
            assert rec["update_norm"] <= max(honest) * (1 + 1e-4), rec
            checked[entry["scale"]] += 1
    assert all(checked.values()), f"the attacker never got into a round: {log}"
    for handle in (a, b):  # the model survived: far below the ~5.5 nats/byte of a random init
        assert handle.info()["val_loss"] < 3.5
