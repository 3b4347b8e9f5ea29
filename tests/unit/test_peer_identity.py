"""DHT records bound to the writer's identity: what the validator refuses (protocol.peer_identity)."""

import dataclasses
import time
from types import SimpleNamespace

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from protocol.peer_identity import (CLOCK_SKEW_S, IdentityError, OwnedRecordValidator, bind, load_identity, make_room,
                                    owner_of, peer_id_of, write_identity)

KEY = DHTID.generate(source="locomesh.run.peers").to_bytes()


def _signed(validator: OwnedRecordValidator, subkey: bytes, value: object = None, ttl: float = 8.0,
            key: bytes = KEY) -> DHTRecord:
    record = DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value or {"round": 1}), get_dht_time() + ttl)
    return dataclasses.replace(record, value=validator.sign_value(record))


@pytest.fixture(scope="module")
def honest() -> OwnedRecordValidator:
    return OwnedRecordValidator(max_ttl=60.0, max_subkeys=3)


@pytest.fixture(scope="module")
def attacker() -> OwnedRecordValidator:
    return OwnedRecordValidator()


def test_an_owned_signed_record_is_accepted_and_names_its_signer(honest):
    record = _signed(honest, honest.owned_subkey())
    assert honest.validate(record)
    assert owner_of(MSGPackSerializer.loads(record.subkey)) == honest.peer_id
    assert MSGPackSerializer.loads(honest.strip_value(record)) == {"round": 1}


def test_a_record_written_for_another_peer_is_refused(honest, attacker):
    # the attacker's own key under the victim's peer id: signed, but the id is not the key's
    forged = _signed(attacker, honest.peer_id.encode() + attacker.local_public_key)
    assert honest.refusal(forged) is not None and "another peer" in honest.refusal(forged)
    # the victim's owner tag, signed by the attacker: the signature does not match
    stolen = _signed(attacker, honest.owned_subkey())
    assert "signature" in honest.refusal(stolen)
    assert owner_of(honest.peer_id.encode() + attacker.local_public_key) is None


def test_records_without_an_owner_are_refused(honest):
    for subkey in (honest.peer_id.encode(), b"anything", None):
        record = DHTRecord(KEY, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps({"round": 1}), get_dht_time() + 8)
        assert not honest.validate(record), subkey


def test_an_expiration_beyond_the_ttl_is_refused(honest):
    assert honest.validate(_signed(honest, honest.owned_subkey(), ttl=60 + CLOCK_SKEW_S - 1))
    year = _signed(honest, honest.owned_subkey(), ttl=365 * 86400)
    assert "expiration" in honest.refusal(year)


def test_a_signature_over_another_value_or_expiration_is_refused(honest):
    record = _signed(honest, honest.owned_subkey(), value={"round": 1})
    signature = record.value[len(MSGPackSerializer.dumps({"round": 1})):]
    altered = dataclasses.replace(record, value=MSGPackSerializer.dumps({"round": 1000}) + signature)
    assert "signature" in honest.refusal(altered)
    later = dataclasses.replace(record, expiration_time=record.expiration_time + 10)
    assert "signature" in honest.refusal(later)


def _bound(validator: OwnedRecordValidator):
    """A real hivemind storage and cache behind ``bind`` (hivemind's protocol, as far as bind sees it)."""
    calls = {"n": 0}

    def whole(key_bytes, dictionary):
        calls["n"] += 1
        return True

    protocol = SimpleNamespace(storage=DHTLocalStorage(), cache=DHTLocalStorage(), _validate_dictionary=whole)
    bind(SimpleNamespace(protocol=protocol), validator)
    return protocol, calls


def _store(storage: DHTLocalStorage, signer: OwnedRecordValidator, ttl: float, value: object = None) -> bool:
    record = _signed(signer, signer.owned_subkey(), value=value, ttl=ttl)
    return storage.store_subkey(DHTID.from_bytes(KEY), signer.owned_subkey(), record.value, record.expiration_time)


def _live(storage: DHTLocalStorage) -> set[bytes]:
    dictionary = storage.get(DHTID.from_bytes(KEY)).value
    return {sk for sk, item in dictionary.items() if item.expiration_time >= get_dht_time()}


def test_throwaway_subkeys_that_expire_late_give_way_to_members_that_renew(honest):
    """1,024 throwaway subkeys stored to expire in 20 minutes used to refuse every newcomer for that long
    (readers apply an 8 s TTL and never use them): now a newcomer expiring sooner takes the place of the
    one that expires last, a newcomer that would expire last is refused, and a stored member may always refresh."""
    validator = OwnedRecordValidator(honest._private_key, max_ttl=1200.0, max_subkeys=3)
    protocol, _ = _bound(validator)
    sybils = [OwnedRecordValidator() for _ in range(3)]
    for i, sybil in enumerate(sybils):
        assert _store(protocol.storage, sybil, ttl=1100 + i)
    newcomer = OwnedRecordValidator()
    assert _store(protocol.storage, newcomer, ttl=8)
    assert _live(protocol.storage) == {sybils[0].owned_subkey(), sybils[1].owned_subkey(), newcomer.owned_subkey()}
    assert not _store(protocol.storage, OwnedRecordValidator(), ttl=1150), "expires after every live one: refused"
    assert _store(protocol.storage, sybils[0], ttl=1199, value={"round": 2}), "a stored member may refresh"
    assert _store(protocol.cache, newcomer, ttl=8), "the cache is capped the same way"


def test_expired_subkeys_count_for_nothing() -> None:
    dictionary = DictionaryDHTValue()
    for i in range(3):
        dictionary.store(f"stale{i}".encode(), b"v", get_dht_time() + 0.05)
    time.sleep(0.1)
    with dictionary.freeze():  # frozen, as while hivemind serves it: the expired ones are still there
        assert len(dictionary) == 3
        assert make_room(dictionary, b"newcomer", get_dht_time() + 1100, 3)


def test_a_whole_dictionary_over_the_cap_is_refused_and_a_full_local_copy_refuses_no_read(honest):
    validator = OwnedRecordValidator(honest._private_key, max_ttl=60.0, max_subkeys=3)
    protocol, calls = _bound(validator)
    for _ in range(3):
        assert _store(protocol.storage, OwnedRecordValidator(), ttl=8)
    big = DictionaryDHTValue()
    for i in range(4):
        big.store(f"sk{i}".encode(), b"v", get_dht_time() + 8)
    assert protocol._validate_dictionary(KEY, big) is False
    # another node's copy, with a member this node's full copy lacks, is read (it used to be refused)
    member = OwnedRecordValidator()
    record = _signed(member, member.owned_subkey())
    assert validator.validate(record)
    small = DictionaryDHTValue()
    small.store(member.owned_subkey(), record.value, record.expiration_time)
    assert protocol._validate_dictionary(KEY, small) is True and calls["n"] == 1


def test_identity_files_round_trip_and_refuse_other_keys(tmp_path):
    key = write_identity(tmp_path / "id")
    assert peer_id_of(load_identity(tmp_path / "id")) == peer_id_of(key)
    (tmp_path / "junk").write_bytes(b"\x08\x01\x12\x03abc")  # an Ed25519 key type
    with pytest.raises(IdentityError, match="RSA"):
        load_identity(tmp_path / "junk")


def test_a_private_swarm_stores_and_reads_only_records_sealed_with_its_key():
    member = OwnedRecordValidator(swarm_key=b"k" * 32)
    reader = OwnedRecordValidator(swarm_key=b"k" * 32)
    sealed = _signed(member, member.owned_subkey())
    assert reader.refusal(sealed) is None
    assert MSGPackSerializer.loads(reader.strip_value(sealed)) == {"round": 1}
    # a keyless stranger's record is owned and signed, but carries no proof of the key
    stranger = OwnedRecordValidator()
    trailing = dataclasses.replace(sealed, value=sealed.value + b"\n")  # "$" matched before it; "\Z" does not
    assert "swarm key" in reader.refusal(trailing)
    unsealed = _signed(stranger, stranger.owned_subkey())
    assert "swarm key" in reader.refusal(unsealed)
    # another swarm's key, or a proof copied onto another value or expiration, is refused too
    other = OwnedRecordValidator(swarm_key=b"x" * 32)
    assert "swarm key" in reader.refusal(_signed(other, other.owned_subkey()))
    moved = dataclasses.replace(sealed, expiration_time=sealed.expiration_time + 1)
    assert "swarm key" in reader.refusal(moved)
    # and a node without the key does not take a private swarm's record for one of its own: it counts it,
    # so a joiner can say that the run is a private swarm (node.runtime.barrier.check_joinable)
    keyless = OwnedRecordValidator()
    assert "--swarm-key" in keyless.refusal(sealed) and keyless.foreign_seals == 1
    assert keyless.refusal(unsealed) is None and keyless.foreign_seals == 1
