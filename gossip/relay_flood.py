"""The ``relayed`` attack, for experiments: a member floods the others with relayed streams from made-up origins.

A node behind NAT is reached through ``/locomesh/relayed`` streams that a relay opens to it, each naming the
origin it carries (``protocol.relay``). Per-client limits (streams at once, ``get_state`` requests per
second) key on that origin, so a peer that could open relayed streams itself, naming a fresh origin
(with a fresh RSA key, so the end-to-end handshake passes) on each, would escape every one of them and make
the target sign a handshake per stream. A node takes relayed streams only from the relays that hold its
reservations, so a member doing this is refused at the first frame.

At each of its rounds the attacker opens ``RELAYED_STREAMS`` relayed streams to every other member, cycling
through ``RELAYED_ORIGINS`` fresh origin keys, each asking for the whole state, and logs what happened to
them: how many were refused (and why) and how many were served.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Sequence

from hivemind.utils.crypto import RSAPrivateKey

from protocol import circuit, ids
from protocol.auth import client_hello
from protocol.errors import ProtocolError, RemoteError
from protocol.hivemind_transport import Transport
from protocol.peer_identity import peer_id_of

logger = logging.getLogger(__name__)

RELAYED_STREAMS = 40  # per member and round: past the 32 streams a client may hold at once
RELAYED_ORIGINS = 8  # fresh origin keys, cycled through (each would have its own per-client limits)
STREAM_TIMEOUT_S = 10.0


class RelayFlood:
    """One attacker's flood: its made-up origins and the tally of what its streams met."""

    def __init__(self, transport: Transport, run_id: str) -> None:
        self.transport, self.run_id = transport, run_id
        self.origins: list[RSAPrivateKey] = []
        self.outcomes: Counter[str] = Counter()

    async def round(self, members: Sequence[str]) -> None:
        """Open ``RELAYED_STREAMS`` relayed streams to each of ``members`` (other than this node) at once,
        wait for them all, then log the tally so far."""
        if not self.origins:  # RSA keys take ~0.1 s each: made once, off the event loop
            self.origins = await asyncio.to_thread(lambda: [RSAPrivateKey() for _ in range(RELAYED_ORIGINS)])
        targets = [m for m in members if m != self.transport.peer_id]
        tasks = [self._one(target, self.origins[i % len(self.origins)]) for target in targets for i in range(RELAYED_STREAMS)]
        for outcome in await asyncio.gather(*tasks):
            self.outcomes[outcome] += 1
        logger.warning("relayed flood (--attack relayed): %d streams so far: %s", sum(self.outcomes.values()),
                       ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())))

    async def _one(self, target: str, origin_key: RSAPrivateKey) -> str:
        """One relayed stream to ``target`` naming ``origin_key``'s id as its origin: ``served`` when the target
        answered with its state, else why not."""
        origin = peer_id_of(origin_key)
        try:
            stream = await asyncio.wait_for(self.transport.open_libp2p(target, ids.RELAYED), STREAM_TIMEOUT_S)
        except RemoteError as e:
            return f"refused:{e.remote_code}"
        except Exception as e:
            return f"unreachable:{type(e).__name__}"
        try:
            async def speak() -> str:
                await stream.send("relayed", {"from": origin, "protocol": ids.STATE})
                await stream.recv(expect="relay_ok")
                await circuit.client_handshake(stream, origin_key, ids.STATE, origin, target)
                await client_hello(stream, self.transport.swarm_key, ids.STATE, origin, target)
                await stream.send("get_state", {"run_id": self.run_id})
                await stream.recv(expect="state")
                return "served"

            return await asyncio.wait_for(speak(), STREAM_TIMEOUT_S)
        except RemoteError as e:
            return f"refused:{e.remote_code}"
        except ProtocolError as e:
            return f"failed:{e.code}"
        except Exception as e:
            return f"failed:{type(e).__name__}"
        finally:
            await stream.close()
