"""Members agree on a round's contribution screen over real DHT nodes (each with its own p2pd): members
whose own screens differ (other data, other hardware) drop the same peers; a voter that never
publishes stalls nobody once every outcome is decided; a verdict that speaks for another peer, or
comes from outside the round, counts for nothing."""

import asyncio
import time

from hivemind.utils import get_dht_time

from gossip.screen_votes import agree_on_screen, publish_verdict
from protocol.peer_identity import owned_subkey
from protocol.records import ScreenVerdict, screen_key
from tests.helpers.dht_swarm import start_dhts, stop_dhts

RUN = "screen-votes"


def test_members_with_different_screens_drop_the_same_peers_and_a_silent_voter_stalls_nobody():
    async def go():
        p2ps, dhts, validators = await start_dhts(5)
        try:
            a, b, c, z, outsider = [d.peer_id.to_base58() for d in dhts]
            voters = [a, b, c, z]
            # b's own data also judges a harmful; z (the attacker) would drop every honest member
            screens = {a: {z}, b: {z, a}, c: {z}, z: {a, b, c}}
            # an outsider drops a, and publishes a verdict in c's name under its own key: neither counts
            await publish_verdict(dhts[4], validators[4], RUN, ScreenVerdict(outsider, 0, [a, b]))
            await dhts[4].store(screen_key(RUN, 0), ScreenVerdict(c, 0, [a, b]).to_value(), get_dht_time() + 60,
                                subkey=owned_subkey(outsider, validators[4]))
            results = await asyncio.gather(*(agree_on_screen(dhts[i], validators[i], RUN, 0, p, voters, screens[p], 30.0)
                                             for i, p in enumerate(voters)))
            assert [r.dropped for r in results] == [{z}] * 4, results
            assert results[1].overruled == {a} and results[0].overruled == set() and results[3].overruled == {a, b, c, z}
            # round 1: z never publishes; every outcome is decided without it, so nobody waits for it
            started = time.monotonic()
            honest = await asyncio.gather(*(agree_on_screen(dhts[i], validators[i], RUN, 1, p, voters, screens[p], 30.0)
                                            for i, p in enumerate(voters[:3])))
            assert [r.dropped for r in honest] == [{z}] * 3 and all(r.decided for r in honest), honest
            assert time.monotonic() - started < 15, "a silent voter held the round up"
            # round 2: split honest verdicts with z silent: z's outcome hangs on it until the timeout, then "keep"
            split = await asyncio.gather(agree_on_screen(dhts[0], validators[0], RUN, 2, a, [a, b, z], {z}, 3.0),
                                         agree_on_screen(dhts[1], validators[1], RUN, 2, b, [a, b, z], set(), 3.0))
            assert [r.dropped for r in split] == [set(), set()] and not any(r.decided for r in split), split
        finally:
            await stop_dhts(p2ps, dhts)

    asyncio.run(go())
