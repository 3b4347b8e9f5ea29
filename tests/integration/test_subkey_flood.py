"""A key filled with throwaway subkeys does not lock members out (two real DHT nodes, each with its p2pd).

An attacker with free ids stores a key's whole subkey cap of member records set to expire in ~18
minutes (the store allows 20; readers of member records apply an 8 s TTL and never use them). On the
code this was filed against, the honest node then refused every new member for those 18 minutes. Now a
record that expires sooner takes the place of the one that expires last, so the next member's record is
stored and read. The node's cap is lowered to 8 (a constructor argument) so the attacker needs 8 keys,
not 1,024.
"""

from __future__ import annotations

import asyncio

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from gossip.rendezvous import list_peers, publish_peer
from protocol.peer_identity import OwnedRecordValidator, bind, identified_p2p
from protocol.records import PeerRecord, peers_key

CAP = 8


async def _flood(attacker: DHTNode, run: str) -> int:
    """Store CAP throwaway member records, each under a fresh id, expiring in ~18 minutes."""
    stored = 0
    for _ in range(CAP):
        signer = OwnedRecordValidator()
        attacker.protocol.record_validator = signer  # signs the record as its owner
        try:
            ok = await attacker.store(peers_key(run), PeerRecord(peer_id=signer.peer_id, round=1).to_value(),
                                      get_dht_time() + 1100, subkey=signer.owned_subkey())
        finally:
            attacker.protocol.record_validator = None
        stored += bool(ok)
    return stored


def test_throwaway_subkeys_do_not_lock_new_members_out_of_a_key() -> None:
    async def go() -> None:
        p1, honest_key = await identified_p2p(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        honest_key.max_subkeys = CAP
        honest = await DHTNode.create(p2p=p1, record_validator=honest_key)
        bind(honest, honest_key)
        maddrs = [str(m) for m in await p1.get_visible_maddrs()]
        p2, _ = await identified_p2p(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        attacker = await DHTNode.create(p2p=p2, initial_peers=maddrs, record_validator=None)
        p3, member_key = await identified_p2p(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        member = await DHTNode.create(p2p=p3, initial_peers=maddrs, record_validator=member_key)
        try:
            assert await _flood(attacker, "run") == CAP, "the honest node stored the whole flood"
            record = PeerRecord(peer_id=member_key.peer_id, round=1)
            assert await publish_peer(member, member_key, "run", record, ttl=8), "a new member's record is stored"
            peers = await list_peers(honest, "run")
            assert member_key.peer_id in peers, sorted(peers)
        finally:
            for node in (member, attacker, honest):
                await node.shutdown()
            for p2p in (p3, p2, p1):
                await p2p.shutdown()

    asyncio.run(asyncio.wait_for(go(), 120))
