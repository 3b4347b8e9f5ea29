"""DHT records bound to the writer's libp2p identity.

A locomesh node signs its DHT records with the RSA key that is also its libp2p identity (the key
p2pd runs with), so the peer id a record speaks for is derived from the key that signed it, never
read from text the writer chose. Every record is an owned subkey ``<peer id>[owner:<ssh-rsa key>]``
signed by that key (hivemind's :class:`RSASignatureValidator` checks the signature over key,
subkey, value and expiration); :class:`OwnedRecordValidator` also refuses:

- a record without an owner (a plain value, or a subkey without ``[owner:…]``);
- a subkey whose peer id is not the one derived from its owner key (someone speaking for another peer);
- an expiration farther than ``max_ttl`` + ``CLOCK_SKEW_S`` from now (a record that outlives its writer);
- in a private swarm (``swarm_key``), a record without ``[swarm:<HMAC>]`` at the end of its value: an
  HMAC-SHA256 with the swarm key over key, subkey, signed value and expiration. p2pd has no pre-shared
  key option, so a keyless stranger can still reach the DHT, but nothing it writes is stored or read.

A key's local copy holds at most ``max_subkeys`` live subkeys (:func:`bind`). When it is full, a new
subkey takes the place of the one that expires last, if it expires sooner itself, and is refused
otherwise. Readers use a record only within its key's TTL (8 s for a member), so throwaway subkeys
stored to expire in 20 minutes are the first to go, and a flood must be renewed every few seconds to
keep a key full. A member already stored may always refresh its own subkey, and expired subkeys count
for nothing. The cap applies to what this node stores; a copy read from another node is not refused
because the local one is full.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

logger = logging.getLogger(__name__)

MAX_RECORD_TTL_S = 1200.0  # the longest any locomesh record lives (a round entry: 4 × a 300 s gather)
CLOCK_SKEW_S = 30.0  # how far ahead of ours a writer's clock may run
MAX_SUBKEYS = 1024  # owned subkeys one key may hold (members of a run, entries of a round, claims of a stage)
_OWNED = re.compile(rb"\A([1-9A-HJ-NP-Za-km-z]{20,64})\[owner:(.+)\]\Z", re.S)  # \Z: "$" also matches before a final newline
_SWARM_PROOF = re.compile(rb"\[swarm:([0-9a-f]{64})\]\Z")


class IdentityError(ValueError):
    """An identity file that cannot serve as a locomesh identity."""


def load_identity(path: str | Path) -> RSAPrivateKey:
    """The RSA private key in a libp2p identity file (hivemind's format: a protobuf PrivateKey)."""
    try:
        proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
    except Exception as e:
        raise IdentityError(f"{path} is not a libp2p identity file ({e}); delete it to have a new one made") from None
    if proto.key_type != crypto_pb2.KeyType.RSA:
        raise IdentityError(f"{path} holds a {crypto_pb2.KeyType.Name(proto.key_type)} key; locomesh signs its DHT records "
                            f"with the identity and needs an RSA one: delete the file to have one made")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = serialization.load_der_private_key(proto.data, password=None)
    return key


def write_identity(path: str | Path, key: RSAPrivateKey | None = None) -> RSAPrivateKey:
    """Write ``key`` (a new one if None) to ``path`` as a libp2p identity file, atomically, mode 0400."""
    key = key or RSAPrivateKey()
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o400)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return key


@functools.lru_cache(maxsize=4096)
def peer_id_of_key(ssh_public_key: bytes) -> str:
    """The libp2p peer id of an RSA public key (``ssh-rsa …``, as hivemind writes owner tags)."""
    der = RSAPublicKey.from_bytes(ssh_public_key)._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    proto = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(proto).digest(), multihash.coerce_code("sha2-256"))).to_base58()


def peer_id_of(key: RSAPrivateKey) -> str:
    """The libp2p peer id of ``key``'s holder."""
    return peer_id_of_key(key.get_public_key().to_bytes())


def owner_of(subkey: object) -> str | None:
    """The peer id an owned subkey claims, when it is the one its owner key derives; else None.
    (The signature is checked apart, by the validator: this only parses and binds.)"""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNED.match(subkey)
    if match is None:
        return None
    try:
        derived = peer_id_of_key(match.group(2))
    except Exception:
        return None
    return derived if derived == match.group(1).decode() else None


class _Throttled:
    """One warning line per reason a minute: a flood of bad records must not flood the log."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def warn(self, reason: str, detail: str) -> None:
        now = time.monotonic()
        if now - self.last.get(reason, -1e9) >= 60.0:
            self.last[reason] = now
            logger.warning("refused a DHT record: %s (%s); further ones refused for this reason are not logged for a minute",
                           reason, detail)


def owned_subkey(peer_id: str, validator: RSASignatureValidator) -> bytes:
    """A subkey only the holder of ``validator``'s private key can write (readers accept it only when
    ``peer_id`` is the peer id of that key: the node's libp2p identity)."""
    return peer_id.encode() + validator.local_public_key


class OwnedRecordValidator(RSASignatureValidator):
    """hivemind's RSA signature check plus the owner binding, expiration and swarm-key checks above."""

    def __init__(self, private_key: RSAPrivateKey | None = None, max_ttl: float = MAX_RECORD_TTL_S,
                 max_subkeys: int = MAX_SUBKEYS, swarm_key: bytes | None = None) -> None:
        super().__init__(private_key or RSAPrivateKey())
        self.max_ttl, self.max_subkeys, self.swarm_key = max_ttl, max_subkeys, swarm_key
        self.peer_id = peer_id_of(self._private_key)
        self.foreign_seals = 0  # records refused because a swarm key this node does not hold sealed them
        self._log = _Throttled()

    @property
    def identity(self) -> RSAPrivateKey:
        """The RSA key records are signed with: the node's libp2p identity."""
        return self._private_key

    def owned_subkey(self) -> bytes:
        """The subkey under which this node writes its record of a key."""
        return owned_subkey(self.peer_id, self)

    def _swarm_proof(self, record: DHTRecord) -> bytes:
        assert self.swarm_key is not None
        message = b"locomesh-record|" + MSGPackSerializer.dumps(dataclasses.astuple(record))
        return hmac.new(self.swarm_key, message, hashlib.sha256).hexdigest().encode()

    def _unsealed(self, record: DHTRecord) -> DHTRecord | None:
        """``record`` without its swarm-key proof, or None when it lacks a valid one in a private swarm or
        carries one in a public swarm (a public swarm's record is returned as it is)."""
        proof = _SWARM_PROOF.search(record.value)
        if self.swarm_key is None:
            if proof is not None:
                self.foreign_seals += 1
                return None
            return record
        if proof is None:
            return None
        inner = dataclasses.replace(record, value=record.value[: proof.start()])
        if hmac.compare_digest(proof.group(1), self._swarm_proof(inner)):
            return inner
        self.foreign_seals += 1
        return None

    def sign_value(self, record: DHTRecord) -> bytes:
        """The RSA signature (hivemind's), then in a private swarm the swarm-key proof over the signed value."""
        value = super().sign_value(record)
        if self.swarm_key is None:
            return value
        return value + b"[swarm:" + self._swarm_proof(dataclasses.replace(record, value=value)) + b"]"

    def strip_value(self, record: DHTRecord) -> bytes:
        if self.swarm_key is not None:
            record = dataclasses.replace(record, value=_SWARM_PROOF.sub(b"", record.value))
        return super().strip_value(record)

    def validate(self, record: DHTRecord) -> bool:
        reason = self.refusal(record)
        if reason is not None:
            self._log.warn(reason, f"expires in {record.expiration_time - get_dht_time():.0f}s")
            return False
        return True

    def refusal(self, record: DHTRecord) -> str | None:
        """Why ``record`` is refused, or None when it is valid."""
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            return "its subkey is not msgpack"
        if owner_of(subkey) is None:
            return ("it has no owned subkey <peer id>[owner:<key>] whose peer id is its key's "
                    "(an unsigned record, or one written for another peer)")
        if record.expiration_time > get_dht_time() + self.max_ttl + CLOCK_SKEW_S:
            return f"its expiration is more than {self.max_ttl:.0f}s + {CLOCK_SKEW_S:.0f}s ahead (a writer's clock far ahead, or a record meant to outlive its writer)"
        unsealed = self._unsealed(record)
        if unsealed is None:
            if self.swarm_key is None:
                return "it is sealed with a private swarm's key, which this node was not given (--swarm-key)"
            return "it carries no valid proof of the swarm key (written by a node outside this private swarm)"
        if not super().validate(unsealed):
            return "its signature does not match its owner key (altered or forged)"
        return None

    def merge_with(self, other: object) -> bool:
        return isinstance(other, RSASignatureValidator)


def bind(dht: object, validator: OwnedRecordValidator) -> None:
    """Cap the live subkeys a key holds in ``dht``'s storage and cache at ``validator.max_subkeys`` (see
    the module docstring), and refuse whole dictionaries (hivemind replicates a key's dictionary in one
    message) holding more than the cap."""
    protocol = dht.protocol  # type: ignore[attr-defined]
    for storage in (protocol.storage, getattr(protocol, "cache", None)):
        if storage is not None:  # (an empty storage is falsy)
            _cap_subkeys(storage, validator)
    check = protocol._validate_dictionary

    def bounded(key_bytes: bytes, dictionary: object) -> bool:
        if len(dictionary) > validator.max_subkeys:  # type: ignore[arg-type]
            validator._log.warn(f"a dictionary holds more than {validator.max_subkeys} subkeys", f"{len(dictionary)}")  # type: ignore[arg-type]
            return False
        return check(key_bytes, dictionary)

    protocol._validate_dictionary = bounded


def _cap_subkeys(storage: Any, validator: OwnedRecordValidator) -> None:
    store_subkey = storage.store_subkey

    def capped(key: Any, subkey: Any, value: bytes, expiration_time: float) -> bool:
        stored = storage.get(key)
        dictionary = stored.value if stored is not None else None
        if isinstance(dictionary, DictionaryDHTValue) and not make_room(dictionary, subkey, expiration_time,
                                                                        validator.max_subkeys):
            validator._log.warn(f"its key holds {validator.max_subkeys} live subkeys expiring sooner",
                                f"expires in {expiration_time - get_dht_time():.0f}s")
            return False
        return store_subkey(key, subkey, value, expiration_time)

    storage.store_subkey = capped


def make_room(dictionary: DictionaryDHTValue, subkey: Any, expiration_time: float, cap: int) -> bool:
    """Whether ``subkey`` (expiring at ``expiration_time``) may be stored in ``dictionary``: always when it
    is there already or fewer than ``cap`` live subkeys are; else the live subkey that expires last is
    dropped for it when that one expires later than it would (then True), and it is refused (False)."""
    now = get_dht_time()
    with dictionary.freeze():
        if subkey in dictionary:
            return True
        live = [(item.expiration_time, key) for key, item in dictionary.items() if item.expiration_time >= now]
    if len(live) < cap:
        return True
    latest, victim = max(live, key=lambda entry: entry[0])
    if latest <= expiration_time:
        return False
    del dictionary[victim]
    return True


async def identified_p2p(**kwargs: Any) -> tuple[P2P, OwnedRecordValidator]:
    """A p2pd started with a new RSA identity, and the validator that signs DHT records with it (for
    tools and tests that join a run's DHT without a node; ``kwargs`` go to ``P2P.create``)."""
    key = RSAPrivateKey()
    with tempfile.TemporaryDirectory(prefix="locomesh-id-") as folder:
        write_identity(f"{folder}/identity", key)
        p2p = await P2P.create(identity_path=f"{folder}/identity", check_if_identity_free=False, **kwargs)
    return p2p, OwnedRecordValidator(key)
