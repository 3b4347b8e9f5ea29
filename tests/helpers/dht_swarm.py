"""Real DHT nodes in one process for tests: each with its own p2pd and locomesh identity, all knowing
each other (as heartbeats make them in a running swarm)."""

from __future__ import annotations

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from protocol.peer_identity import OwnedRecordValidator, bind, identified_p2p


async def start_dhts(count: int) -> tuple[list[P2P], list[DHTNode], list[OwnedRecordValidator]]:
    """``count`` DHT nodes on loopback, the first the others' initial peer; each has looked itself up once."""
    p2ps, dhts, validators = [], [], []
    try:
        for _ in range(count):
            initial = [str(a) for a in await p2ps[0].get_visible_maddrs()] if p2ps else []
            p2p, validator = await identified_p2p(initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            p2ps.append(p2p)
            dht = await DHTNode.create(p2p=p2p, initial_peers=initial, record_validator=validator)
            bind(dht, validator)
            dhts.append(dht)
            validators.append(validator)
        for dht in dhts:
            await dht.find_nearest_nodes([dht.node_id])
    except BaseException:
        await stop_dhts(p2ps, dhts)
        raise
    return p2ps, dhts, validators


async def stop_dhts(p2ps: list[P2P], dhts: list[DHTNode]) -> None:
    """Shut the nodes and their daemons down."""
    for dht in dhts:
        await dht.shutdown()
    for p2p in p2ps:
        await p2p.shutdown()
