"""Round rendezvous through the DHT: who is in the run, and who joins outer round r.

Every member keeps a signed PeerRecord under ``peers_key(run)`` (subkey = its peer id + public key,
the key its libp2p identity is, so nobody else can write it: see protocol.peer_identity; a reader
takes the peer id from the verified owner key, never from a record's text). For outer round r each
member stores a RoundEntry under ``round_key(run, r)`` and polls until every live member that
announced round r (and answers a probe: ``gossip.reachable``) has registered, or the gather deadline
passes; late or dead members are left out of that round. Records and round entries of peers of
another protocol version are left out of everything (``protocol.version``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections import Counter
from typing import Awaitable, Callable

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.traverse import traverse_dht
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from gossip.dht_io import answers, in_background, store_here, store_owned, waited
from gossip.quorum import GatherTimes, round_grace
from protocol.errors import SchemaError
from protocol.peer_identity import CLOCK_SKEW_S, MAX_RECORD_TTL_S, MAX_SUBKEYS, OwnedRecordValidator, owned_subkey, owner_of
from protocol.records import PEER_RECORD_TTL_S, PeerRecord, RoundEntry, peers_key, round_key
from protocol.version import compatible, note_incompatible

logger = logging.getLogger(__name__)


_reader: OwnedRecordValidator | None = None


def _checker(dht: DHTNode) -> OwnedRecordValidator:
    """The DHT's own validator when it is locomesh's, else one that only checks (a tool's plain DHT)."""
    global _reader
    validator = dht.protocol.record_validator
    if isinstance(validator, OwnedRecordValidator):
        return validator
    if _reader is None:
        _reader = OwnedRecordValidator(RSAPrivateKey.process_wide())
    return _reader


FULL_READ_PEERS = 8  # up to this many routing-table peers, a read asks them all; beyond, the key's nearest nodes


async def _nearest_copies(dht: DHTNode, key_id: DHTID, ask: Callable[..., Awaitable[dict | None]]) -> list[object]:
    """The key's stored copies on the ``num_replicas`` nodes nearest to it (where stores put them),
    found by hivemind's beam search: O(log N) requests plus the replicas, whatever the swarm's size."""
    width = max(dht.num_replicas, 3)
    node_to_peer = dict(dht.protocol.routing_table.get_nearest_neighbors(key_id, width, exclude=dht.node_id))
    copies: list[object] = []

    async def get_neighbors(node: DHTID, queries) -> dict:
        response = await ask(node_to_peer[node])
        if not response or key_id not in response:
            return {q: ((), False) for q in queries}
        found, neighbours = response[key_id]
        if found is not None:
            copies.append(found.value)
        node_to_peer.update(neighbours)
        return {key_id: (tuple(neighbours), False)}

    await traverse_dht([key_id], initial_nodes=list(node_to_peer), beam_size=width, num_workers=width, queries_per_call=1,
                       get_neighbors=get_neighbors, visited_nodes={key_id: {dht.node_id}})
    return copies


READ_TIMEOUT_S = 3.0  # the longest a DHT read waits for one peer's answer
MIN_READ_S = 0.3  # the shortest: a rendezvous past its deadline still reads once more


async def read_subkeys(dht: DHTNode, key: str, timeout: float = READ_TIMEOUT_S, max_ttl: float = MAX_RECORD_TTL_S) -> dict[str, tuple[object, float]]:
    """{peer id: (value, expiration time)} of a key's owned subkeys, freshest copy of each subkey.

    Only subkeys signed by the key their peer id derives from are read, none expiring more than
    ``max_ttl`` (+ clock skew) from now, and at most ``MAX_SUBKEYS`` of them (the local copy's first).

    hivemind's ``get(latest=True)`` returns the one stored dictionary whose newest subkey is newest,
    so with several writers refreshing their own subkeys it can hide another writer's fresh subkey
    behind a stale copy. So this asks for the stored copies themselves and merges them subkey by
    subkey: in a small swarm (up to ``FULL_READ_PEERS`` routing-table peers) from every peer it knows,
    and from the owners of subkeys it learned about; in a larger one from the key's nearest nodes,
    which hold every writer's copy because stores go there (a read then costs O(log N) requests).
    """
    key_id = DHTID.generate(source=key)
    dictionaries = []
    local = dht.protocol.storage.get(key_id)
    if local is not None:
        dictionaries.append(local.value)
    peers = list(dht.protocol.routing_table.peer_id_to_uid)

    async def ask(peer):
        try:
            return await asyncio.wait_for(dht.protocol.call_find(peer, [key_id]), timeout)
        except Exception:  # a slow or gone peer only means one copy fewer
            return None

    def collect(responses) -> None:
        for response in responses:
            if response and response.get(key_id) and response[key_id][0] is not None:
                dictionaries.append(response[key_id][0].value)

    if len(peers) > FULL_READ_PEERS:
        dictionaries.extend(await _nearest_copies(dht, key_id, ask))
        return _merge(dht, key_id, dictionaries, max_ttl)
    collect(await answers(ask, peers, timeout))
    # owners of subkeys we learned about but did not ask yet (e.g. a client that knows one peer)
    asked = {str(p) for p in peers} | {str(dht.peer_id)}
    owners = set()
    for dictionary in dictionaries:
        if isinstance(dictionary, DictionaryDHTValue):
            with dictionary.freeze():
                owners |= {o for o in (owner_of(sk) for sk, _ in dictionary.items()) if o and o not in asked}
    extra = []
    for owner in owners:
        try:
            extra.append(PeerID.from_base58(owner))
        except Exception:
            continue
    collect(await answers(ask, extra[:MAX_SUBKEYS], timeout))
    return _merge(dht, key_id, dictionaries, max_ttl)


def _merge(dht: DHTNode, key_id: DHTID, dictionaries: list, max_ttl: float = MAX_RECORD_TTL_S) -> dict[str, tuple[object, float]]:
    """The freshest valid copy of every owned subkey across ``dictionaries`` (the local copy first), by owner."""
    freshest: dict[object, tuple[bytes, float]] = {}
    for dictionary in dictionaries:
        if not isinstance(dictionary, DictionaryDHTValue):
            continue
        with dictionary.freeze():
            for subkey, item in dictionary.items():
                if subkey not in freshest or item.expiration_time > freshest[subkey][1]:
                    freshest[subkey] = (item.value, item.expiration_time)
    validator = _checker(dht)
    now = get_dht_time()
    limit = now + max_ttl + CLOCK_SKEW_S
    out: dict[str, tuple[object, float]] = {}
    for subkey, (raw, expiration) in freshest.items():
        if len(out) >= MAX_SUBKEYS:
            logger.warning("key holds more than %d valid subkeys; reading the first %d only", MAX_SUBKEYS, MAX_SUBKEYS)
            break
        peer = owner_of(subkey)
        if peer is None or expiration > limit or expiration < now:  # (a frozen copy still holds expired ones)
            continue
        record = DHTRecord(key_id.to_bytes(), dht.protocol.serializer.dumps(subkey), raw, expiration)
        if validator.refusal(record) is not None:
            continue
        try:
            out[peer] = (dht.protocol.serializer.loads(validator.strip_value(record)), expiration)
        except Exception:
            continue
    return out


def rejoin_target(my_round: int, other_rounds: list[int]) -> int | None:
    """The round this node should move to, or None to stay.

    The target is the round most live trainers are in (ties go to the higher round). A node behind it
    moves forward; a node that raced ahead alone by two rounds or more while the majority was
    elsewhere (a partition) moves back to the majority. Records lag by up to one heartbeat, so being
    one round ahead of the majority is normal and left alone.
    """
    counts = Counter(other_rounds)
    counts[my_round] += 1
    target, target_count = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    if target > my_round or (my_round - target >= 2 and target_count > counts[my_round]):
        return target
    return None


FAR_AHEAD = 2  # a round more than this ahead of a node's own is a claim to check (see plausible_rounds)


def plausible_rounds(my_round: int, rounds: dict[str, int], established: Callable[[str], bool]) -> dict[str, int]:
    """``{peer: round}`` less the claims a node should not follow: a round more than ``FAR_AHEAD``
    ahead of ``my_round`` counts only when a strict majority of the trainers (this node included)
    announce it, or when its peer is established (has taken part in this node's rounds). A record's
    round is its writer's word: one fresh peer announcing round R+1000 must not make a node of a
    two-node swarm jump there and download the announcer's state."""
    total = len(rounds) + 1
    counts = Counter(rounds.values())
    return {p: r for p, r in rounds.items()
            if r <= my_round + FAR_AHEAD or 2 * counts[r] > total or established(p)}


async def reconnect_routing_table(dht: DHTNode, peer_ids: list, timeout: float = 3.0) -> int:
    """Ping connected peers missing from the DHT routing table; returns how many were (re)added.

    hivemind drops a peer from its routing table after one unanswered request and re-adds it only
    when that peer contacts us. In a small swarm two nodes can end up storing records only locally,
    each seeing a stale mix of the other's dictionary subkeys. Pinging every connected peer that is
    not in the table keeps stores replicated on every member.
    """
    missing = [p for p in peer_ids if p != dht.peer_id and p not in dht.protocol.routing_table]
    if not missing:
        return 0

    async def ping(peer) -> bool:
        try:
            return await asyncio.wait_for(dht.protocol.call_ping(peer), timeout) is not None
        except Exception:
            return False

    return sum(await asyncio.gather(*(ping(p) for p in missing)))


async def publish_peer(dht: DHTNode, validator: RSASignatureValidator, run_id: str, record: PeerRecord, ttl: float) -> bool:
    """Store (refresh) this node's PeerRecord, in its own storage at once, then on the key's nearest nodes (as
    :func:`register_round`); it expires ``ttl`` seconds from now unless refreshed."""
    return await store_owned(dht, peers_key(run_id), owned_subkey(record.peer_id, validator), record.to_value(), get_dht_time() + ttl)


def publish_peer_here(dht: DHTNode, validator: RSASignatureValidator, run_id: str, record: PeerRecord, ttl: float) -> bool:
    """:func:`publish_peer` into this node's own storage only (readers ask this node too): no request, no wait."""
    return store_here(dht, peers_key(run_id), owned_subkey(record.peer_id, validator), record.to_value(), get_dht_time() + ttl)


async def spread_peer(dht: DHTNode, validator: RSASignatureValidator, run_id: str, record: PeerRecord, ttl: float) -> bool:
    """:func:`publish_peer` on the key's nearest nodes only (hivemind's store), for a record :func:`publish_peer_here`
    already put into this node's storage."""
    return await dht.store(peers_key(run_id), record.to_value(), get_dht_time() + ttl, subkey=owned_subkey(record.peer_id, validator))


async def list_peers(dht: DHTNode, run_id: str) -> dict[str, PeerRecord]:
    """Live members of ``run_id`` with valid records of this node's protocol version (malformed records
    are dropped and logged; incompatible ones are dropped and logged once per peer, see ``protocol.version``)."""
    return {peer: record for peer, (record, _) in (await list_peers_with_expiry(dht, run_id)).items()}


_record_watchers: "weakref.WeakKeyDictionary[DHTNode, list[Callable[[dict[str, PeerRecord]], None]]]" = weakref.WeakKeyDictionary()


def watch_records(dht: DHTNode, callback: Callable[[dict[str, PeerRecord]], None]) -> None:
    """Call ``callback`` with every set of valid peer records read through ``dht`` (the transport
    learns from them which relays reach a peer behind NAT)."""
    _record_watchers.setdefault(dht, []).append(callback)


async def list_peers_with_expiry(dht: DHTNode, run_id: str, compatible_only: bool = True) -> dict[str, tuple[PeerRecord, float]]:
    """Like :func:`list_peers`, with each record's DHT expiration time (``compatible_only=False``:
    peers of other protocol versions too, for ``node status``)."""
    peers: dict[str, tuple[PeerRecord, float]] = {}
    for peer, (value, expiration) in (await read_subkeys(dht, peers_key(run_id), max_ttl=PEER_RECORD_TTL_S)).items():
        try:
            record = PeerRecord.from_value(value)
        except SchemaError as e:
            logger.warning("ignoring malformed peer record of %s: %s", peer, e)
            continue
        if record.peer_id != peer:
            logger.warning("ignoring peer record of %s that claims to be %s", peer, record.peer_id)
            continue
        if compatible_only and note_incompatible(peer, record.version, record.protocol) is not None:
            continue  # node status (compatible_only=False) shows it in its table instead of a log line
        peers[peer] = (record, expiration)
    for callback in _record_watchers.get(dht, []):
        callback({p: r for p, (r, _) in peers.items() if compatible(r.protocol)})
    return peers


async def round_members(dht: DHTNode, run_id: str, round_no: int, role: str = "trainer") -> set[str]:
    """Members (of ``role``) whose latest record says they are in this round (or finishing the previous one)."""
    peers = await list_peers(dht, run_id)
    return {p for p, rec in peers.items() if rec.round in (round_no - 1, round_no) and rec.role == role}


async def read_round_entries(dht: DHTNode, run_id: str, round_no: int, group: str = "",
                             timeout: float = READ_TIMEOUT_S) -> dict[str, tuple[RoundEntry, float]]:
    """{peer: (its entry, the entry's expiration time)} of round ``round_no``'s rendezvous (of ``group``'s, if named),
    waiting at most ``timeout`` seconds for each peer asked."""
    entries: dict[str, tuple[RoundEntry, float]] = {}
    for peer, (value, expiration) in (await read_subkeys(dht, round_key(run_id, round_no, group), timeout)).items():
        try:
            candidate = RoundEntry.from_value(value)
        except SchemaError as e:
            logger.warning("ignoring malformed round entry of %s: %s", peer, e)
            continue
        if candidate.peer_id == peer and compatible(candidate.protocol):  # another version never joins a round
            entries[peer] = (candidate, expiration)
    return entries


async def register_round(
    dht: DHTNode, validator: RSASignatureValidator, run_id: str, round_no: int, entry: RoundEntry, ttl: float, group: str = ""
) -> bool:
    """Store this member's entry in round ``round_no``'s rendezvous (``group``'s, if named), expiring ``ttl`` seconds
    from now: in this node's own storage at once (members' reads ask every peer they know, this one included), then
    on the key's nearest nodes (hivemind's store, which waits seconds for a peer that stopped answering)."""
    return await store_owned(dht, round_key(run_id, round_no, group), owned_subkey(entry.peer_id, validator), entry.to_value(), get_dht_time() + ttl)


REGISTER_WAIT_S = 0.5  # the longest a rendezvous waits for its entry's DHT store before it polls


async def register_soon(
    dht: DHTNode, validator: RSASignatureValidator, run_id: str, round_no: int, entry: RoundEntry, ttl: float, group: str = ""
) -> None:
    """:func:`register_round`, waited for at most ``REGISTER_WAIT_S``: the entry is readable from this node at once,
    and the nearest nodes' copies follow in the background (a peer that stopped answering held hivemind's store
    7 s, past the rendezvous deadline, live)."""
    stored = in_background(register_round(dht, validator, run_id, round_no, entry, ttl, group), f"storing round {round_no}'s entry")
    if not await waited(stored, REGISTER_WAIT_S):
        logger.info("round %d: the DHT store of this node's entry is slow (a peer does not answer); gathering meanwhile", round_no)


FIRST_POLLS = (0.02, 0.04, 0.08)  # seconds before the rendezvous's 2nd, 3rd and 4th reads (a few extra DHT reads a round)
MEMBERS_EVERY_S = 1.0  # how often a rendezvous reads again which members it waits for
ELSEWHERE_CHECK_S = 1.0  # how often a rendezvous looks for its awaited peers in the round's other groupings
POKED_POLL_S = 0.02  # the shortest pause between two polls when members' requests bring them forward


async def gather_group(
    dht: DHTNode,
    validator: RSASignatureValidator,
    run_id: str,
    round_no: int,
    entry: RoundEntry,
    expected: Callable[[], Awaitable[set[str]]],
    timeout: float,
    poll_interval: float = 0.2,
    group: str = "",
    elsewhere: Callable[[set[str]], Awaitable[set[str]]] | None = None,
    poke: asyncio.Event | None = None,
    quorum: Callable[[int], int] | None = None,
    times: GatherTimes | None = None,
    grace_from: float | None = None,
) -> tuple[list[RoundEntry], bool]:
    """Register for round ``round_no`` (in ``group``'s rendezvous, if named); returns the group
    (sorted by peer id, self included) and whether it is complete.

    Returns once every peer in ``expected()`` has registered (complete), or after ``timeout`` seconds.
    The first polls come quickly (``FIRST_POLLS``: members of a round usually register within a
    fraction of a second of each other, and a whole ``poll_interval`` of waiting would be most of a
    dense round on a fast link), then every ``poll_interval``. Each poll reads the round's entries; the
    members it waits for (``expected()``, a read of every member's record) are read again every
    ``MEMBERS_EVERY_S`` and before the group is called complete (8 members polling both every 0.2 s
    kept two CPU cores busy with DHT requests).
    ``elsewhere(awaited)``, asked every ``ELSEWHERE_CHECK_S`` while peers are awaited, names those of
    them that registered in another rendezvous of the round (another grouping): they are not waited for.
    ``poke``, when set (a member asked this node for the round's contribution: it found the group complete),
    brings the next poll forward, to at least ``POKED_POLL_S`` after the last one began.
    ``quorum(n)``, when given, is how many of ``n`` expected members (this one included) close the group early: once
    that many registered, it closes the round's grace later (``gossip.quorum``: the largest grace their entries
    propose, none if one proposes none; counted from ``grace_from`` at the earliest, ``time.monotonic()``), if that comes
    before the deadline. ``times`` is told how it ended.
    """
    times = times if times is not None else GatherTimes()
    await register_soon(dht, validator, run_id, round_no, entry, min(max(60.0, 4 * timeout), MAX_RECORD_TTL_S), group)
    deadline = time.monotonic() + timeout
    entries: dict[str, RoundEntry] = {entry.peer_id: entry}
    moved: set[str] = set()
    polls = 0
    next_check = time.monotonic() + ELSEWHERE_CHECK_S
    members: set[str] = set()
    members_read = -math.inf
    close_at = deadline  # (the grace after a quorum may bring it forward)
    while True:
        if poke is not None:
            poke.clear()  # a poke that comes during this poll's reads brings the next one forward
        polled = time.monotonic()
        # each read waits for a peer that does not answer (a frozen process) at most until the deadline
        budget = min(READ_TIMEOUT_S, max(MIN_READ_S, close_at - polled))
        entries.update({peer: e for peer, (e, _) in (await read_round_entries(dht, run_id, round_no, group, timeout=budget)).items()})
        waiting_for = members - set(entries) - moved
        if not waiting_for or time.monotonic() - members_read >= MEMBERS_EVERY_S:
            try:
                members = await asyncio.wait_for(expected(), max(MIN_READ_S, close_at - time.monotonic()))
            except asyncio.TimeoutError:  # as above: the members read last time stand (the deadline has passed)
                if members_read == -math.inf:  # none read yet: nobody can call the group complete
                    times.closed_by = "deadline"
                    return [entries[p] for p in sorted(entries)], False
            members_read = time.monotonic()
            waiting_for = members - set(entries) - moved
        if waiting_for and elsewhere is not None and time.monotonic() >= next_check:
            next_check = time.monotonic() + ELSEWHERE_CHECK_S
            found = await elsewhere(waiting_for)
            if found:
                logger.info("round %d: not waiting for %s: they registered in another grouping of the round", round_no, sorted(found))
                moved |= found
                waiting_for -= found
        close_at = deadline if quorum is None else _close_at(deadline, entry.peer_id, members - moved, entries, quorum,
                                                             times, grace_from)
        if not waiting_for or time.monotonic() >= close_at:
            times.closed_by = "complete" if not waiting_for else "grace" if close_at < deadline else "deadline"
            if times.closed_by == "grace":
                logger.info("round %d: closed %.1f s after a quorum without %s", round_no, times.grace_s, sorted(waiting_for))
            elif waiting_for:
                logger.info("round %d: gave up waiting for %s", round_no, sorted(waiting_for))
            return [entries[p] for p in sorted(entries)], not waiting_for
        polls += 1
        pause = FIRST_POLLS[polls - 1] if polls <= len(FIRST_POLLS) else poll_interval
        pause = min(pause, max(0.0, close_at - time.monotonic()))
        if poke is None:
            await asyncio.sleep(pause)
            continue
        try:
            await asyncio.wait_for(poke.wait(), pause)
            # a peer that pokes again and again costs a read every POKED_POLL_S at most
            await asyncio.sleep(max(0.0, polled + POKED_POLL_S - time.monotonic()))
        except asyncio.TimeoutError:
            pass


def _close_at(deadline: float, me: str, members: set[str], entries: dict[str, RoundEntry], quorum: Callable[[int], int],
              times: GatherTimes, grace_from: float | None = None) -> float:
    """When a rendezvous of ``members`` (this member, ``me``, counted in) with ``entries`` registered so far closes: at the
    deadline, or the round's grace after a quorum registered (``gossip.quorum``). Notes the quorum's time in ``times``
    the first poll it holds, and the grace."""
    group = members | {me}
    arrived = [p for p in group if p in entries]
    needed = quorum(len(group))
    if needed >= len(group) or len(arrived) < needed:
        return deadline
    if times.quorum_at is None:
        times.quorum_at = time.monotonic()
    times.grace_s = round_grace(entries[p].grace_s for p in arrived)
    return deadline if times.grace_s is None else min(deadline, times.grace_start(grace_from) + times.grace_s)
