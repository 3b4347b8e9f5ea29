"""Schemas of the DHT records locomesh publishes, with validation on read.

Records are plain msgpack-able maps. Every reader goes through ``from_value`` so that a malformed
or hostile record is dropped (with a :class:`SchemaError`) instead of crashing the node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from protocol.errors import SchemaError
from protocol.version import protocol_version


PEER_RECORD_TTL_S = 8.0  # a PeerRecord expires this long after its last refresh (the heartbeat refreshes it)


def peers_key(run_id: str) -> str:
    """DHT key under which every member of ``run_id`` keeps one (signed) subkey with its PeerRecord."""
    return f"locomesh.{run_id}.peers"


def round_key(run_id: str, round_no: int, group: str = "") -> str:
    """DHT key of the rendezvous for outer round ``round_no`` of ``run_id`` (of one of its groups, when
    the round is split into bounded groups: ``group`` names it)."""
    return f"locomesh.{run_id}.round.{round_no}" + (f".{group}" if group else "")


def _typed(value: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in value:
        if default is ...:
            raise SchemaError(f"record lacks field {name!r}")
        return default
    item = value[name]
    if isinstance(item, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise SchemaError(f"record field {name!r} must be {kind}, got bool")
    if not isinstance(item, kind):
        raise SchemaError(f"record field {name!r} must be {kind}, got {type(item).__name__}")
    return item


@dataclass
class PeerRecord:
    """What a node announces about itself (refreshed every heartbeat, expires if it stops)."""

    peer_id: str
    role: str = "trainer"
    device: str = "cpu"
    model: str = "tiny"
    algorithm: str = "diloco"
    compression: str = "none"
    round: int = 0
    inner_step: int = 0
    tokens_per_s: float = 0.0
    loss: float = float("nan")
    maddrs: list[str] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    version: str = ""
    started_at: float = 0.0
    stage: int = -1  # pipeline stage served (-1: none)
    queue: int = 0  # requests waiting at a stage server
    grad_norm: float = 0.0  # a stage server's last gradient norm
    stage_since: float = 0.0  # when it began serving that stage (unix time)
    up_mbit: float = 0.0  # its --max-upload-mbit (0: none): a joiner downloading from it waits that much longer
    reachability: str = "unknown"  # public | private | unknown: whether others can dial it (private: through relays)
    protocol: int = field(default_factory=protocol_version)  # protocol version (protocol.version); a record read without one is from before it existed (1)

    def to_value(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> "PeerRecord":
        if not isinstance(value, dict):
            raise SchemaError(f"peer record must be a map, got {type(value).__name__}")
        number = (int, float)
        rec = cls(
            peer_id=_typed(value, "peer_id", str),
            role=_typed(value, "role", str, "trainer"),
            device=_typed(value, "device", str, "cpu"),
            model=_typed(value, "model", str, ""),
            algorithm=_typed(value, "algorithm", str, ""),
            compression=_typed(value, "compression", str, "none"),
            round=_typed(value, "round", int, 0),
            inner_step=_typed(value, "inner_step", int, 0),
            tokens_per_s=float(_typed(value, "tokens_per_s", number, 0.0)),
            loss=float(_typed(value, "loss", number, float("nan"))),
            maddrs=list(_typed(value, "maddrs", list, [])),
            protocols=list(_typed(value, "protocols", list, [])),
            version=_typed(value, "version", str, ""),
            started_at=float(_typed(value, "started_at", number, 0.0)),
            stage=_typed(value, "stage", int, -1),
            queue=_typed(value, "queue", int, 0),
            grad_norm=float(_typed(value, "grad_norm", number, 0.0)),
            stage_since=float(_typed(value, "stage_since", number, 0.0)),
            reachability=_typed(value, "reachability", str, "unknown"),
            up_mbit=float(_typed(value, "up_mbit", number, 0.0)),
            protocol=_typed(value, "protocol", int, 1),
        )
        if not all(isinstance(x, str) for x in rec.maddrs + rec.protocols):
            raise SchemaError("record fields 'maddrs' and 'protocols' must hold strings")
        if rec.reachability not in ("public", "private", "unknown"):
            raise SchemaError(f"record reachability must be public, private or unknown, got {rec.reachability!r}")
        if not 0 <= rec.up_mbit < float("inf"):
            raise SchemaError("record up_mbit must be a non-negative number")
        if rec.round < 0 or rec.inner_step < 0 or rec.queue < 0 or rec.stage < -1:
            raise SchemaError("record round, inner_step and queue must be non-negative, stage ≥ -1")
        return rec


@dataclass
class RoundEntry:
    """A member's entry in a round rendezvous: who it is, how many samples its update carries, its
    upload cap (``--max-upload-mbit``, 0: none), so the others wait long enough for its update, and its
    measured speed (tokens/s of inner steps, 0: not measured), from which every member of the round
    paces the next one alike (``node.replica.pacing``), and the grace it proposes to close the round under
    once a quorum came (seconds, 0: none; ``gossip.quorum``)."""

    peer_id: str
    samples: int
    codec: str
    up_mbit: float = 0.0
    protocol: int = field(default_factory=protocol_version)  # the member's protocol version (protocol.version)
    tokens_per_s: float = 0.0
    grace_s: float = 0.0

    def to_value(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> "RoundEntry":
        if not isinstance(value, dict):
            raise SchemaError(f"round entry must be a map, got {type(value).__name__}")
        entry = cls(
            peer_id=_typed(value, "peer_id", str), samples=_typed(value, "samples", int), codec=_typed(value, "codec", str),
            up_mbit=float(_typed(value, "up_mbit", (int, float), 0.0)),
            protocol=_typed(value, "protocol", int, 1),
            tokens_per_s=float(_typed(value, "tokens_per_s", (int, float), 0.0)),
            grace_s=float(_typed(value, "grace_s", (int, float), 0.0)),
        )
        if entry.samples < 0:
            raise SchemaError("round entry samples must be non-negative")
        if not 0 <= entry.up_mbit < float("inf"):
            raise SchemaError("round entry up_mbit must be a non-negative number")
        if not 0 <= entry.tokens_per_s < float("inf"):
            raise SchemaError("round entry tokens_per_s must be a non-negative number")
        if not 0 <= entry.grace_s < float("inf"):
            raise SchemaError("round entry grace_s must be a non-negative number")
        return entry


MAX_VERDICT_PEERS = 256  # peers one screen verdict may name (a round's group is far smaller)


def screen_key(run_id: str, round_no: int) -> str:
    """DHT key under which each member of round ``round_no`` keeps its contribution-screen verdict."""
    return f"locomesh.{run_id}.screen.{round_no}"


@dataclass
class ScreenVerdict:
    """A member's verdict on round ``round``'s contributions (``gossip.screen_votes``): the peers whose
    update its screen would drop."""

    peer_id: str
    round: int
    dropped: list[str] = field(default_factory=list)

    def to_value(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> "ScreenVerdict":
        if not isinstance(value, dict):
            raise SchemaError(f"screen verdict must be a map, got {type(value).__name__}")
        dropped = _typed(value, "dropped", list)
        if len(dropped) > MAX_VERDICT_PEERS or not all(isinstance(p, str) and len(p) <= 128 for p in dropped):
            raise SchemaError(f"screen verdict must name at most {MAX_VERDICT_PEERS} peer ids")
        return cls(peer_id=_typed(value, "peer_id", str), round=_typed(value, "round", int), dropped=sorted(set(dropped)))
