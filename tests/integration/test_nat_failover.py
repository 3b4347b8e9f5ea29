"""A relay that dies mid-run: two homes behind NAT keep averaging through the other public peer.

Two public peers and two homes (benchmarks.nat_topology); the homes join through both public peers,
so each reserves a circuit on both. Once rounds average all four, the first public peer is SIGKILLed.
The homes must go on averaging together (through the second relay) in rounds of all three survivors.
Slow (about two minutes) and needs root.
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from benchmarks.nat_topology import NatTopology, NsNode, missing_tools
from tests.helpers.swarm_utils import full_rounds

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(missing_tools() is not None, reason=f"NAT tests: {missing_tools()}")]

ARGS = ["--model", "nano", "--inner-steps", "20", "--threads", "1", "--run-id", "nat-failover"]


@pytest.fixture
def net() -> Iterator[tuple[NatTopology, list[NsNode]]]:
    started: list[NsNode] = []
    with NatTopology(homes=2, public_hosts=2, tag="fo") as topology:
        try:
            yield topology, started
        finally:
            for node in started:
                node.kill()


def test_homes_keep_averaging_through_the_second_relay_when_the_first_dies(tmp_path, net) -> None:
    topology, nodes = net
    pub0 = NsNode(topology, topology.public[0], tmp_path, "pub0", ARGS, [])
    nodes.append(pub0)
    info = pub0.wait(lambda i: i.get("state") == "training", 120, "startup")
    boot0 = next(a for a in info["multiaddrs"] if f"/ip4/{topology.public[0].address}/" in a)
    pub1 = NsNode(topology, topology.public[1], tmp_path, "pub1", [*ARGS, "--seed", "1"], [boot0])
    nodes.append(pub1)
    info = pub1.wait(lambda i: i.get("state") == "training", 120, "startup")
    boot1 = next(a for a in info["multiaddrs"] if f"/ip4/{topology.public[1].address}/" in a)
    homes = [NsNode(topology, host, tmp_path, f"home{h}", [*ARGS, "--seed", str(2 + h)], [boot0, boot1])
             for h, host in enumerate(topology.home)]
    nodes += homes
    for home in homes:
        home.wait(lambda i: len(full_rounds(i, 4)) >= 2, 300, "2 rounds of all four")
        relays = [a for a in home.info()["multiaddrs"] if "/p2p-circuit" in a]
        assert len(relays) == 2, relays
    killed_at = time.time()
    pub0.kill()
    for home in homes:
        home.wait(lambda i: len(full_rounds(i, 3, after=killed_at)) >= 3, 300, "3 rounds of the three survivors")
    for node in (*homes, pub1):
        assert node.stop() == 0, node.log()[-2000:]
    for home in homes:
        assert home.info()["bytes_relayed"].get("received", 0) > 0
