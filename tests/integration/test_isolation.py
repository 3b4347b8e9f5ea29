"""Run isolation and record ownership: other runs never mix in; nobody overwrites another's DHT record;
a checkpoint survives its writer being killed mid-save."""

import asyncio
import json
import signal
import subprocess
import sys
import time

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from gossip.rendezvous import list_peers, publish_peer
from protocol.peer_identity import owned_subkey
from node.checkpoints import checkpoint
from protocol.peer_identity import bind, identified_p2p
from protocol.records import PeerRecord, peers_key
from tests.helpers.swarm_utils import FAST_ARGS, start_node
from tests.helpers import zygote


def test_peers_of_another_run_never_enter_a_group(tmp_path, nodes):
    a = start_node(tmp_path, "a", FAST_ARGS + ["--run-id", "run-one"])
    nodes.append(a)
    boot = a.multiaddr()
    b = start_node(tmp_path, "b", FAST_ARGS + ["--run-id", "run-two", "--join-timeout", "3"], [boot])
    nodes.append(b)
    for h in (a, b):
        h.wait(lambda i: i.get("outer_rounds", 0) >= 3, 180, "3 rounds")
    out = zygote.run(["status", "--initial-peers", boot, "--run-id", "run-one", "--json"],
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert [p["peer_id"] for p in json.loads(out.stdout)["peers"]] == [a.info()["peer_id"]]
    for h in (a, b):
        assert h.stop() == 0
        info = h.info()
        assert info["joined_round"] is None, "a node of another run must not download this run's state"
        assert all(r["group"] == 1 and r["contributors"] == 1 for r in info["rounds"])


def test_a_peer_cannot_overwrite_another_peers_record():
    async def go():
        p1, owner_key = await identified_p2p(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        d1 = await DHTNode.create(p2p=p1, record_validator=owner_key)
        bind(d1, owner_key)
        maddrs = [str(m) for m in await p1.get_visible_maddrs()]
        p2, thief_key = await identified_p2p(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        d2 = await DHTNode.create(p2p=p2, initial_peers=maddrs, record_validator=thief_key)
        owner = owner_key.peer_id
        try:
            assert await publish_peer(d1, owner_key, "run", PeerRecord(peer_id=owner, round=1), ttl=8)
            forged = PeerRecord(peer_id=owner, round=99).to_value()
            # the thief signs with its own key under the owner's subkey: every honest node refuses it
            stored = await d2.store(peers_key("run"), forged, get_dht_time() + 8, subkey=owned_subkey(owner, owner_key))
            assert not stored
            # nor may it name the owner's peer id with its own key
            stored = await d2.store(peers_key("run"), forged, get_dht_time() + 8, subkey=owned_subkey(owner, thief_key))
            assert not stored
            peers = await list_peers(d1, "run")
            assert peers[owner].round == 1
        finally:
            await d2.shutdown()
            await p2.shutdown()
            await d1.shutdown()
            await p1.shutdown()

    asyncio.run(go())


WRITER = """
import sys, torch
sys.path.insert(0, {root!r})
from node.checkpoints.checkpoint import save_atomic
i = 0
print("ready", flush=True)
while True:
    i += 1
    save_atomic({{"round": i, "w": torch.full((1 << 21,), float(i))}}, {path!r})
"""


def test_checkpoint_survives_sigkill_during_save(tmp_path):
    import os

    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic({"round": 0, "w": __import__("torch").zeros(1 << 21)}, path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for delay in (0.3, 0.55, 0.8):
        proc = subprocess.Popen([sys.executable, "-c", WRITER.format(root=root, path=str(path))], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"ready"
            time.sleep(delay)
        finally:  # an interrupted run must not leave the writer looping
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        state = checkpoint.load(path)  # whatever moment the kill hit, a whole checkpoint loads
        assert bool((state["w"] == float(state["round"])).all())
    assert checkpoint.newest_valid(tmp_path) is not None
