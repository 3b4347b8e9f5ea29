"""Private swarms: the ``hello`` handshake that opens every stream when a node runs with ``--swarm-key``.

Each side proves it holds the key with HMAC-SHA256(key, "locomesh-swarm" | role | protocol | client
id | server id). libp2p already authenticates both peer ids, so a proof is bound to this pair of
peers and this protocol and cannot be replayed by anyone else. Transport-neutral: the hivemind
adapter and the py-libp2p light client both use it.
"""

from __future__ import annotations

import hashlib
import hmac

from protocol.errors import AuthError
from protocol.frames import HELLO_MAX_FRAME, FramedStream

HELLO = "hello"


def swarm_proof(key: bytes, role: str, protocol: str, client: str, server: str) -> bytes:
    """The proof ``role`` ("client" or "server") sends on a ``protocol`` stream from ``client`` to ``server``."""
    msg = "|".join(("locomesh-swarm", role, protocol, client, server)).encode()
    return hmac.new(key, msg, hashlib.sha256).digest()


async def client_hello(stream: FramedStream, key: bytes, protocol: str, client: str, server: str) -> None:
    """Client side: send our proof now; the stream's first ``recv`` then checks the server's proof."""
    await stream.send(HELLO, {"mac": swarm_proof(key, "client", protocol, client, server)})
    stream.expected_hello = swarm_proof(key, "server", protocol, client, server)


async def server_hello(stream: FramedStream, key: bytes, protocol: str, client: str, server: str) -> None:
    """Server side: check the client's proof (refusing with :class:`AuthError`), then send ours."""
    msg = await stream.recv(max_size=HELLO_MAX_FRAME)  # nothing bigger is decoded before the key is proved
    mac = msg.body.get("mac") if msg.kind == HELLO else None
    if not isinstance(mac, bytes) or not hmac.compare_digest(mac, swarm_proof(key, "client", protocol, client, server)):
        raise AuthError("this is a private swarm: the request did not prove it holds the swarm key (--swarm-key)")
    await stream.send(HELLO, {"mac": swarm_proof(key, "server", protocol, client, server)})
