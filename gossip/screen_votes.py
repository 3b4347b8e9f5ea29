"""Members of a round agree on its contribution screen (``gossip.scores``) by a majority of their verdicts.

A member's screen depends on inputs the others do not share: its scoring batches come from its own
``--data`` and its losses from its own hardware's arithmetic. Two honest members may then judge an
update differently, and members that drop different peers step φ apart (the next round's fingerprint
vote resyncs the minority: a whole-state download). So after screening, each member stores its
verdict, the peers it would drop, in the DHT under the round's screen key (an owned subkey: nobody
writes another's verdict), and reads the others':

- the voters are the contributors the screen judged (the round's members in sync, this one included);
  a verdict of anyone else, or the part of one naming a peer outside them, counts for nothing;
- a peer is dropped when a strict majority of the voters drop it; a missing verdict counts as "keep";
- a member stops reading as soon as every peer's outcome is decided (no missing verdict could change
  it), so a voter that never publishes stalls nobody while the others agree; otherwise it reads until
  ``timeout`` and decides with what it has.

Every member that read every verdict, or saw every outcome decided, drops the same peers. A member
that timed out with an undecided peer may still differ (a slow or silent voter among split honest
verdicts); the fingerprint vote settles that, as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from gossip.rendezvous import read_subkeys
from protocol.errors import SchemaError
from protocol.peer_identity import owned_subkey
from protocol.records import ScreenVerdict, screen_key

logger = logging.getLogger(__name__)

POLL_S = (0.05, 0.1, 0.2, 0.4)  # waits between reads, then the last one repeated
VERDICT_TTL_S = 120.0  # a verdict outlives its round's reads


@dataclass
class ScreenAgreement:
    """The peers the voters' majority drops, the verdicts read, and where this member's own verdict lost."""

    dropped: set[str]
    verdicts: int
    overruled: set[str] = field(default_factory=set)  # peers this member judged otherwise than the majority
    decided: bool = True  # every outcome was decided (False: the read timed out with some undecided)


def tally(voters: Sequence[str], verdicts: Mapping[str, Collection[str]]) -> tuple[set[str], set[str]]:
    """(peers a strict majority of ``voters`` drops, peers whose outcome the missing verdicts could still
    change). Only verdicts of voters count, and each only for peers among the voters."""
    members = set(voters)
    counted = {v: set(verdicts[v]) & members for v in members if v in verdicts}
    missing = len(members) - len(counted)
    need = len(members) // 2 + 1
    dropped, undecided = set(), set()
    for peer in members:
        drops = sum(peer in d for d in counted.values())
        if drops >= need:
            dropped.add(peer)
        elif drops + missing >= need:
            undecided.add(peer)
    return dropped, undecided


async def publish_verdict(dht: DHTNode, validator: RSASignatureValidator, run_id: str, verdict: ScreenVerdict) -> bool:
    """Store this member's verdict under its round's screen key."""
    return await dht.store(screen_key(run_id, verdict.round), verdict.to_value(), get_dht_time() + VERDICT_TTL_S,
                           subkey=owned_subkey(verdict.peer_id, validator))


async def read_verdicts(dht: DHTNode, run_id: str, round_no: int) -> dict[str, set[str]]:
    """{voter: the peers it drops} of round ``round_no``, from well-formed verdicts that speak for their signer."""
    out: dict[str, set[str]] = {}
    for peer, (value, _) in (await read_subkeys(dht, screen_key(run_id, round_no))).items():
        try:
            verdict = ScreenVerdict.from_value(value)
        except SchemaError as e:
            logger.info("ignoring a malformed screen verdict of %s: %s", peer, e)
            continue
        if verdict.peer_id == peer and verdict.round == round_no:
            out[peer] = set(verdict.dropped)
    return out


async def agree_on_screen(dht: DHTNode, validator: RSASignatureValidator, run_id: str, round_no: int, peer_id: str,
                          voters: Sequence[str], mine: Collection[str], timeout: float) -> ScreenAgreement:
    """Publish this member's verdict (``mine``: the peers its screen drops) and return the voters' majority."""
    own = set(mine) & set(voters)
    try:
        await publish_verdict(dht, validator, run_id, ScreenVerdict(peer_id, round_no, sorted(own)))
    except Exception as e:  # the others then count this member's verdict as missing
        logger.warning("round %d: could not store this member's screen verdict: %s", round_no, e)
    deadline = time.monotonic() + timeout
    verdicts: dict[str, set[str]] = {peer_id: own}
    for attempt in itertools.count():  # until every outcome is decided or the deadline passes
        try:
            verdicts.update(await read_verdicts(dht, run_id, round_no))
        except Exception as e:
            logger.info("round %d: could not read the screen verdicts: %s", round_no, e)
        verdicts[peer_id] = own  # what this member decided, whatever a copy in the DHT says
        dropped, undecided = tally(voters, verdicts)
        left = deadline - time.monotonic()
        if not undecided or left <= 0:
            break
        await asyncio.sleep(min(POLL_S[min(attempt, len(POLL_S) - 1)], left))
    counted = sum(v in verdicts for v in voters)
    return ScreenAgreement(dropped, counted, overruled=own ^ dropped, decided=not undecided)
