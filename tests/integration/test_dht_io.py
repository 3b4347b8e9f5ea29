"""A record stored here first is read by a peer before any remote store (real DHT nodes, each with its own p2pd):
what lets a rendezvous go on while hivemind's store still waits for a peer that does not answer, and a node's
heartbeat keep its record alive meanwhile."""

import asyncio
import time
from types import SimpleNamespace

import torch
from hivemind.utils import get_dht_time

from gossip.dht_io import store_here
from gossip.rendezvous import list_peers
from protocol.peer_identity import owned_subkey
from node.runtime.presence import SPREAD_WAIT_S, NetworkPresence
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


class _Member(NetworkPresence):
    """A node's presence over a real DHT node, its record's stores on other nodes hanging (a frozen peer)."""

    def __init__(self, dht, validator, run_id: str) -> None:
        self.net = SimpleNamespace(dht=dht, validator=validator)
        self.cfg = SimpleNamespace(run_id=run_id, model="nano", codec="none", attack=None, max_upload_mbit=0.0)
        self.summary = SimpleNamespace(peer_id=dht.peer_id.to_base58(), multiaddrs=[], protocols=[], reachability="public")
        self.metrics = SimpleNamespace(peers=SimpleNamespace(set=lambda n: None))
        self.role, self.device, self.algorithm, self.round = "trainer", torch.device("cpu"), "diloco", 0
        self.started, self.heartbeats, self.spreads, self.hang = time.monotonic(), 0, 0, asyncio.Event()

    async def _refresh_addresses(self) -> None:
        pass

    async def _spread_record(self, record, runs) -> None:
        self.spreads += 1
        await self.hang.wait()

    def _current_loss(self) -> float:
        return 0.0

    def _record_fields(self) -> dict:
        return {}

    def _record_runs(self) -> list[str]:
        return [self.cfg.run_id]

    def _observe_peers(self, peers) -> None:
        pass


def test_heartbeats_keep_the_record_fresh_where_readers_find_it_while_its_stores_on_other_nodes_hang():
    """Before, a heartbeat awaited hivemind's store (7–10 s for a frozen peer) and came every 10–13 s, past the
    record's 8 s life: the members' own records expired and a rendezvous found nobody to wait for."""
    async def go():
        p2ps, dhts, validators = await start_dhts(2)
        try:
            member = _Member(dhts[0], validators[0], "beat-run")
            me = member.summary.peer_id
            for round_no in (4, 5, 6):
                member.round = round_no
                started = time.monotonic()
                await member._heartbeat()
                assert time.monotonic() - started < SPREAD_WAIT_S + 2, "the heartbeat waited for the hanging stores"
                peers = await list_peers(dhts[1], "beat-run")  # asks the member itself
                assert peers[me].round == round_no, peers
            assert member.spreads == 1, "a heartbeat started another store while the last one still hung"
            member.hang.set()
            await asyncio.sleep(0)
            member.round = 7
            await member._heartbeat()
            assert member.spreads == 2
        finally:
            await stop_dhts(p2ps, dhts)

    asyncio.run(go())
