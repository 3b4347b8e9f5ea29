"""Mixed versions and the start-up barrier, with real daemons.

A peer of another protocol version (faked with ``LOCOMESH_FAKE_PROTOCOL_VERSION``) is refused with one
line naming both versions while the run trains on; a node waiting for a run whose peers stopped says so at
once. (``node swarm`` holding every node until all are in: tests/integration/test_checkpoint_and_cli.py.)
"""

import asyncio

import pytest
from hivemind.p2p import P2P

from node.runtime.status_service import fetch_status
from protocol import ids
from protocol.errors import IncompatiblePeer
from protocol.hivemind_transport import Transport
from protocol.version import LOCOMESH_VERSION as V
from protocol.version import PROTOCOL_VERSION as P
from tests.helpers.swarm_utils import FAST_ARGS, events, start_node

ODD = {"LOCOMESH_FAKE_PROTOCOL_VERSION": "1", "LOCOMESH_FAKE_VERSION": "0.1.0"}  # an outdated peer


def _lines(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


def _ready(info: dict) -> bool:
    return info.get("state") in ("waiting", "training") and bool(info.get("multiaddrs"))


def test_a_peer_of_another_protocol_is_refused_once_and_the_run_trains_on(tmp_path, nodes, monkeypatch):
    a = start_node(tmp_path, "a", FAST_ARGS)
    nodes.append(a)
    boot = a.multiaddr()
    peer_a = a.info()["peer_id"]
    odd = start_node(tmp_path, "odd", FAST_ARGS, [boot], env=ODD)
    nodes.append(odd)
    assert odd.process.wait(timeout=180) == 3, odd.log()[-3000:]
    line = f"peer {peer_a} runs locomesh {V} (protocol {P}); this node runs 0.1.0 (protocol 1): not training with it, " \
           "upgrade this node with `git pull && make setup`"
    assert len(_lines(odd.log(), line)) == 1, odd.log()[-3000:]  # records are read every second: still one line
    assert "runs this node's protocol version 1" in odd.log() and "Traceback" not in odd.log()

    # the hello of every stream: a client of the next protocol is refused by the daemon before any handler,
    # twice, and the daemon logs its line once; status stays version-free
    monkeypatch.setenv("LOCOMESH_FAKE_PROTOCOL_VERSION", str(P + 1))

    async def ask() -> tuple[str, list[str], dict]:
        p2p = await P2P.create(initial_peers=[boot], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        transport = Transport(p2p)
        refusals = []
        try:
            for _ in range(2):
                stream = await transport.open(peer_a, ids.STATE)
                await stream.send("get_state", {"run_id": "locomesh-demo"})
                with pytest.raises(IncompatiblePeer) as e:
                    await asyncio.wait_for(stream.recv(), 30)
                refusals.append(str(e.value))
                await stream.close()
            return transport.peer_id, refusals, await fetch_status(transport, peer_a)
        finally:
            await p2p.shutdown()

    before = a.info()["steps"]
    client, refusals, status = asyncio.run(ask())
    assert all(f"runs locomesh {V} (protocol {P}); this node runs {V} (protocol {P + 1})" in r for r in refusals), refusals
    assert status["protocol"] == P and status["version"] == V
    a.wait(lambda i: i["steps"] > before + 5, 90, "training to go on")
    assert len(_lines(a.log(), f"peer {client} runs locomesh {V} (protocol {P + 1}); this node runs {V} (protocol {P})")) == 1
    assert "Traceback" not in a.log()
    assert a.stop() == 0


def test_a_node_is_told_when_the_run_stops_or_its_peers_do_not_come(tmp_path, nodes):
    alone = start_node(tmp_path, "alone", FAST_ARGS + ["--min-peers", "2", "--join-timeout", "3"])  # a run of its own
    nodes.append(alone)
    args = FAST_ARGS + ["--min-peers", "3", "--join-timeout", "300"]
    a = start_node(tmp_path, "a", args)
    nodes.append(a)
    boot = a.wait(_ready, 90, "startup")["multiaddrs"][0]
    b = start_node(tmp_path, "b", args, [boot])
    nodes.append(b)
    b.wait(lambda i: i.get("state") == "waiting", 120, "waiting for peers")
    assert a.stop() == 0  # the run's only other peer stops while b waits for a third
    assert b.process.wait(timeout=120) == 2, b.log()[-3000:]  # at once, not after --join-timeout (300 s)
    assert len(_lines(b.log(), "ERROR locomesh.node: the run's peers have stopped: …")) == 1, b.log()[-3000:]
    assert events(b, "not_started") and b.info()["steps"] == 0

    assert alone.process.wait(timeout=120) == 2, alone.log()[-3000:]
    assert _lines(alone.log(), "only 1 of --min-peers 2 peers came to run 'locomesh-demo' within --join-timeout 3s")
    assert alone.info()["steps"] == 0
