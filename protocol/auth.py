"""The ``hello`` that opens every stream: both sides' locomesh and protocol versions, and in a private
swarm (``--swarm-key``) the proof that each side holds the key.

The client sends ``hello {protocol, version[, mac]}`` and its request right behind it (no extra round
trip); the server reads the hello first and answers with its own before the reply. A peer of another
protocol version (``protocol.version``) is refused there, before any handler runs: the server still
sends its hello so that the client can name both versions, then the error frame. A peer older than
the hello (protocol 1) sends its request first: it is refused with an error frame written for it.
The status and dial-back exchanges are version-free (tiny maps any version reads), so ``node status``
sees every peer and reachability detection works across versions.

The proof is HMAC-SHA256(key, "locomesh-swarm" | role | protocol | client id | server id). libp2p
already authenticates both peer ids, so a proof is bound to this pair of peers and this protocol and
cannot be replayed by anyone else. Transport-neutral: the hivemind adapter and the py-libp2p light
client both use it.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from protocol import ids
from protocol.errors import AuthError, IncompatiblePeer, SchemaError
from protocol.frames import HELLO_MAX_FRAME, FramedStream, Message
from protocol.version import OLD_VERSION, note_incompatible, package_version, protocol_version

HELLO = "hello"
VERSION_FREE = frozenset({ids.STATUS, ids.DIALBACK})


def swarm_proof(key: bytes, role: str, protocol: str, client: str, server: str) -> bytes:
    """The proof ``role`` ("client" or "server") sends on a ``protocol`` stream from ``client`` to ``server``."""
    msg = "|".join(("locomesh-swarm", role, protocol, client, server)).encode()
    return hmac.new(key, msg, hashlib.sha256).digest()


def hello_body(key: bytes | None, role: str, protocol: str, client: str, server: str) -> dict[str, Any]:
    """What ``role`` says in its hello on a ``protocol`` stream from ``client`` to ``server``."""
    body: dict[str, Any] = {"protocol": protocol_version(), "version": package_version()}
    if key is not None:
        body["mac"] = swarm_proof(key, role, protocol, client, server)
    return body


def peer_versions(body: dict[str, Any]) -> tuple[str, int]:
    """(locomesh version, protocol version) a hello announces; a hello without them is protocol 1's
    (a private swarm's hello before versions were announced)."""
    protocol, version = body.get("protocol", 1), body.get("version", OLD_VERSION)
    if not isinstance(protocol, int) or isinstance(protocol, bool) or not isinstance(version, str):
        raise SchemaError("hello fields 'protocol' and 'version' must be an integer and a string")
    return version, protocol


async def client_hello(stream: FramedStream, key: bytes | None, protocol: str, client: str, server: str) -> None:
    """Client side: send our hello now; the stream's first ``recv`` then checks the server's (its key
    proof, and its protocol version: another one raises :class:`IncompatiblePeer` with the line)."""
    await stream.send(HELLO, hello_body(key, "client", protocol, client, server))

    def check(hello: Message) -> None:
        if key is not None:
            mac = hello.body.get("mac")
            if not isinstance(mac, bytes) or not hmac.compare_digest(mac, swarm_proof(key, "server", protocol, client, server)):
                raise AuthError(f"peer {stream.peer} did not prove it holds the swarm key")
        line = None if protocol in VERSION_FREE else note_incompatible(stream.peer, *peer_versions(hello.body))
        if line is not None:
            raise IncompatiblePeer(line)

    stream.pending_hello = check


async def server_hello(stream: FramedStream, key: bytes | None, protocol: str, client: str, server: str) -> None:
    """Server side: read the client's hello (refusing a missing or wrong key with :class:`AuthError`,
    another protocol version with :class:`IncompatiblePeer`), then send ours."""
    msg = await stream.recv(max_size=HELLO_MAX_FRAME)  # nothing bigger is decoded before the key is proved
    if msg.kind != HELLO:
        if key is not None:
            raise AuthError("this is a private swarm: the request did not prove it holds the swarm key (--swarm-key)")
        if protocol in VERSION_FREE:
            stream.unread = msg  # a peer older than the hello asking for status: answer it anyway
            return
        note_incompatible(client, OLD_VERSION, 1)
        raise IncompatiblePeer(f"this node runs locomesh {package_version()} (protocol {protocol_version()}) and yours is older "
                               "(protocol 1, no version hello): upgrade with `git pull && make setup`")
    mac = msg.body.get("mac")
    if key is None and mac is not None:
        raise SchemaError("this node is not in a private swarm: its streams take no swarm key (leave it out)")
    if key is not None and (not isinstance(mac, bytes) or not hmac.compare_digest(mac, swarm_proof(key, "client", protocol, client, server))):
        raise AuthError("this is a private swarm: the request did not prove it holds the swarm key (--swarm-key)")
    line = None if protocol in VERSION_FREE else note_incompatible(client, *peer_versions(msg.body))
    await stream.send(HELLO, hello_body(key, "server", protocol, client, server))
    if line is not None:
        raise IncompatiblePeer(line)
