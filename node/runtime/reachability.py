"""Whether other peers can dial this node, and the p2pd settings that follow from it.

A node is *public* when a TCP connection from outside reaches its libp2p listener, *private* when
not (behind a NAT or a firewall that drops inbound connections). It finds out by asking a peer to
dial it back over ``/locomesh/dialback/1.0``: the helper connects to the address it sees the request
come from (the NAT's outside address), at each port the node listens on or announces, and checks that
a libp2p listener answers (go-libp2p's listener greets with the multistream header). The helper only
ever dials the requester's own observed address, so the protocol cannot be used to make it connect
to third parties.

Public nodes run p2pd with reachability forced public: they serve the DHT and relay circuits for
private peers (``--relay on``, with p2pd's caps). Private nodes force private reachability, run the
DHT in client mode (their keys live only on dialable peers, so DHT reads never wait on a relay) and
reserve a slot on their initial peers as static relays, so others reach them at
``<relay addr>/p2p-circuit/p2p/<id>``. This is what Petals does on the same daemon.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from hivemind.p2p import P2P

from protocol import ids
from protocol.errors import SchemaError
from protocol.frames import FramedStream, require
from protocol.hivemind_transport import Transport

logger = logging.getLogger(__name__)

REACHABILITY_MODES = ("auto", "public", "private")
MULTISTREAM_HEADER = b"\x13/multistream/1.0.0\n"
MAX_DIALBACK_PORTS = 4
DIAL_TIMEOUT = 3.0
# p2pd's relay caps for the circuits a public peer relays (per circuit: bytes each way, duration)
RELAY_DATA_LIMIT = 1 << 30
RELAY_TIME_LIMIT = "30m0s"
RELAY_MAX_CIRCUITS = 16


class LocomeshP2P(P2P):
    """hivemind's :class:`P2P` with the p2pd flags it does not expose (relay service and discovery).

    ``P2P.create`` builds the p2pd command line through ``_make_process_args``; the extra flags of the
    next ``create`` go in :attr:`extra_flags` (set by :func:`create_p2p` right before the call)."""

    extra_flags: dict[str, Any] = {}

    @classmethod
    def _make_process_args(cls, *args: Any, **kwargs: Any) -> list[str]:
        return P2P._make_process_args(*args, **{**kwargs, **cls.extra_flags})


def p2p_settings(mode: str, initial_peers: Sequence[str], relay_service: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``P2P.create`` keyword arguments, extra p2pd flags) for a node of reachability ``mode``."""
    if mode == "private":
        kwargs: dict[str, Any] = {"force_reachability": "private", "dht_mode": "client", "use_relay": True,
                                  "use_auto_relay": True}
        extra: dict[str, Any] = {"relayService": False}
        if initial_peers:  # reserve on the peers we joined through at once (discovery waits minutes)
            kwargs["trusted_relays"] = list(initial_peers)
            extra["relayDiscovery"] = False
        return kwargs, extra
    kwargs = {"dht_mode": "server", "use_relay": True, "use_auto_relay": False}
    if mode == "public":
        kwargs["force_reachability"] = "public"  # the relay service only runs on a host it thinks public
    extra = {"relayService": relay_service}
    if relay_service:
        extra.update(relayDataLimit=RELAY_DATA_LIMIT, relayTimeLimit=RELAY_TIME_LIMIT, relayMaxCircuits=RELAY_MAX_CIRCUITS)
    return kwargs, extra


async def create_p2p(mode: str, initial_peers: Sequence[str], relay_service: bool, **kwargs: Any) -> P2P:
    """Start p2pd set up for reachability ``mode`` (``public``, ``private`` or ``auto`` = unforced)."""
    settings, extra = p2p_settings(mode, initial_peers, relay_service)
    LocomeshP2P.extra_flags = extra
    return await LocomeshP2P.create(initial_peers=list(initial_peers) or None, **settings, **kwargs)


@dataclass
class Reachability:
    """What this node knows about its reachability."""

    state: str = "unknown"  # public | private | unknown
    detail: str = ""
    dialable: list[str] = field(default_factory=list)  # host:port pairs a helper could dial
    observed: str = ""  # the address the helper saw us come from
    relays: list[str] = field(default_factory=list)  # relay multiaddrs holding a reservation for us

    def to_value(self) -> dict[str, Any]:
        return {"state": self.state, "detail": self.detail, "dialable": self.dialable, "observed": self.observed,
                "relays": self.relays}


def tcp_ports(maddrs: Sequence[str]) -> list[int]:
    """The TCP ports of ``maddrs`` (listen or announce addresses), without circuit addresses, deduplicated."""
    ports: list[int] = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        if "p2p-circuit" in parts or "tcp" not in parts:
            continue
        try:
            port = int(parts[parts.index("tcp") + 1])
        except (ValueError, IndexError):
            continue
        if port and port not in ports:
            ports.append(port)
    return ports


def observed_host(remote_addr: str) -> str | None:
    """The IP of a connection's remote multiaddr (``/ip4/A/tcp/P``), None for a relayed one."""
    parts = remote_addr.split("/")
    if "p2p-circuit" in parts or len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    return parts[2]


async def answers_libp2p(host: str, port: int, timeout: float = DIAL_TIMEOUT) -> bool:
    """Whether a fresh TCP connection to ``host:port`` is accepted by a libp2p listener."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        greeting = await asyncio.wait_for(reader.readexactly(len(MULTISTREAM_HEADER)), timeout)
        return greeting == MULTISTREAM_HEADER
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


async def serve_dialback(stream: FramedStream) -> None:
    """Dial the requester back at its observed address, on the ports it names; answer which worked."""
    msg = await stream.recv(expect="dialback")
    ports = require(msg.body, "ports", list)
    if not ports or len(ports) > MAX_DIALBACK_PORTS or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        raise SchemaError(f"dialback wants 1 to {MAX_DIALBACK_PORTS} TCP ports, got {ports!r}")
    host = observed_host(stream.remote_addr)
    if host is None:
        await stream.send("dialback_result", {"observed": "", "dialable": [], "note": "you reached me through a relay"})
        return
    results = await asyncio.gather(*(answers_libp2p(host, p) for p in ports))
    dialable = [f"{host}:{p}" for p, ok in zip(ports, results) if ok]
    await stream.send("dialback_result", {"observed": host, "dialable": dialable, "note": ""})


async def ask_dialback(transport: Transport, helper: str, ports: Sequence[int], timeout: float = 15.0) -> dict[str, Any]:
    """Ask ``helper`` (a peer id) to dial us back on ``ports``; its answer as a dict."""

    async def exchange() -> dict[str, Any]:
        stream = await transport.open(helper, ids.DIALBACK)
        try:
            await stream.send("dialback", {"ports": list(ports)[:MAX_DIALBACK_PORTS]})
            reply = await stream.recv(expect="dialback_result")
            return {"observed": require(reply.body, "observed", str), "dialable": require(reply.body, "dialable", list),
                    "note": require(reply.body, "note", str)}
        finally:
            transport.account(ids.DIALBACK, stream)
            await stream.close()

    return await asyncio.wait_for(exchange(), timeout)


async def detect(transport: Transport, helpers: Sequence[str], ports: Sequence[int], tries: int = 2) -> Reachability:
    """Ask up to ``tries`` helpers to dial us back. Public when any dial-back reached us, private when
    they all answered and none did, unknown when no helper answered."""
    if not ports:
        return Reachability("private", "this node listens on no TCP port")
    answers, errors = [], []
    for helper in random.sample(list(helpers), min(tries, len(helpers))):
        try:
            answer = await ask_dialback(transport, helper, ports)
        except Exception as e:  # an old peer without the protocol, or one that went away
            errors.append(f"{helper[:12]}…: {type(e).__name__} {e}".strip())
            continue
        answers.append(answer)
        if answer["dialable"]:
            return Reachability("public", f"dialled back at {', '.join(answer['dialable'])}", answer["dialable"],
                                answer["observed"])
    if answers:
        observed = next((a["observed"] for a in answers if a["observed"]), "")
        return Reachability("private", f"{len(answers)} peer(s) could not dial {observed or 'us'} on port(s) "
                            f"{', '.join(map(str, ports))}", [], observed)
    return Reachability("unknown", "no peer answered the dial-back: " + "; ".join(errors))


def relay_addresses(maddrs: Sequence[str]) -> list[str]:
    """This node's circuit addresses among its visible multiaddrs (one per relay holding a reservation)."""
    return [str(a) for a in maddrs if "/p2p-circuit" in str(a)]


def _address_rank(maddr: str) -> int | None:
    """0 for a public address, 1 for a private (LAN) one, None for loopback, link-local or unknown."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return 1 if len(parts) > 1 and parts[1].startswith("dns") else None
    try:
        ip = ipaddress.ip_address(parts[2])
    except ValueError:
        return None
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
        return None
    return 1 if ip.is_private else 0


def dialable_addresses(maddrs: list[str]) -> list[str]:
    """The addresses to give to people on other machines: public ones first, then relayed ones
    (``/p2p-circuit``), then LAN ones; loopback only when nothing else is there."""
    ranked = []
    for i, maddr in enumerate(maddrs):
        rank = 0.5 if "/p2p-circuit" in maddr else _address_rank(maddr)
        if rank is not None:
            ranked.append((rank, i, maddr))
    return [m for _, _, m in sorted(ranked)] or list(maddrs[:1])
