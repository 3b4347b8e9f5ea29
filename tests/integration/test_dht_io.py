"""A record stored here first is read by a peer before any remote store (real DHT nodes, each with its own p2pd):
what lets a rendezvous go on while hivemind's store still waits for a peer that does not answer."""

import asyncio

from hivemind.utils import get_dht_time

from gossip.dht_io import store_here
from gossip.rendezvous import list_peers
from protocol.peer_identity import owned_subkey
from protocol.records import PeerRecord, peers_key
from tests.helpers.dht_swarm import start_dhts, stop_dhts


def test_a_record_stored_only_in_this_nodes_storage_is_read_by_a_peer_and_passes_its_checks():
    async def go():
        p2ps, dhts, validators = await start_dhts(3)
        try:
            me = dhts[0].peer_id.to_base58()
            record = PeerRecord(peer_id=me, round=7, device="cpu", model="nano")
            assert store_here(dhts[0], peers_key("io-run"), owned_subkey(me, validators[0]), record.to_value(), get_dht_time() + 30)
            for reader in dhts[1:]:  # nothing went out: they read it from this node's storage, signature checked
                peers = await list_peers(reader, "io-run")
                assert me in peers and peers[me].round == 7, peers
            # another node's key cannot be written this way: its signature would not match the subkey's owner
            other = dhts[1].peer_id.to_base58()
            forged = PeerRecord(peer_id=other, round=9, device="cpu", model="nano")
            assert not store_here(dhts[0], peers_key("io-run"), owned_subkey(other, validators[1]), forged.to_value(), get_dht_time() + 30)
            assert other not in await list_peers(dhts[2], "io-run")
        finally:
            await stop_dhts(p2ps, dhts)

    asyncio.run(go())
