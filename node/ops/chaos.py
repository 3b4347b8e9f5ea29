"""Fault injection for local swarms (``node swarm --chaos SPEC``): which node to SIGKILL or pause, and when."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChaosAction:
    """One fault to inject (``node swarm --chaos SPEC``): SIGKILL a stage's servers, one node, or a
    random node, or pause it (SIGSTOP its process, SIGCONT ``pause_s`` seconds later: a laptop that slept, a
    stalled machine; its p2pd keeps taking streams), once at ``at`` seconds or every ``every`` seconds."""

    target: str  # "stage", "node" or "random"
    value: int | None
    at: float | None
    every: float | None
    next_t: float = 0.0
    kind: str = "kill"  # or "pause"
    pause_s: float = 0.0

    def __post_init__(self) -> None:
        self.next_t = self.at if self.at is not None else (self.every or 0.0)


def parse_chaos(spec: str) -> ChaosAction:
    """``kill:stage=1:at=60s``, ``kill:node=2:at=30``, ``kill:random:every=45s``, ``pause:node=2:every=30s:for=8s``."""
    parts = spec.split(":")
    if len(parts) < 3 or parts[0] not in ("kill", "pause"):
        raise ValueError(f"--chaos {spec!r}: expected kill:stage=S:at=T, kill:node=I:at=T, kill:random:every=T "
                         "or pause:node=I:every=T:for=S")
    target, value = parts[1].partition("=")[0], parts[1].partition("=")[2]
    if target not in ("stage", "node", "random") or (target != "random" and not value.isdigit()):
        raise ValueError(f"--chaos {spec!r}: the victim is stage=S, node=I or random")
    timing: dict[str, float] = {}
    fields = ("at", "every", "for") if parts[0] == "pause" else ("at", "every")
    for part in parts[2:]:
        key, _, raw = part.partition("=")
        if key not in fields:
            raise ValueError(f"--chaos {spec!r}: unknown field {key!r} (use at=T or every=T"
                             f"{', and for=S' if parts[0] == 'pause' else ''})")
        try:
            timing[key] = float(raw.removesuffix("s"))
        except ValueError:
            raise ValueError(f"--chaos {spec!r}: {key} needs seconds, e.g. {key}=60s") from None
        if timing[key] <= 0:
            raise ValueError(f"--chaos {spec!r}: {key} must be positive")
    pause_s = timing.pop("for", None)
    if len(timing) != 1:
        raise ValueError(f"--chaos {spec!r}: give exactly one of at=T or every=T")
    if parts[0] == "pause" and pause_s is None:
        raise ValueError(f"--chaos {spec!r}: a pause needs for=S, how long the node stays stopped")
    if pause_s is not None and timing.get("every") is not None and pause_s >= timing["every"]:
        raise ValueError(f"--chaos {spec!r}: for=S must be shorter than every=T")
    return ChaosAction(target, int(value) if value else None, timing.get("at"), timing.get("every"), kind=parts[0],
                       pause_s=pause_s or 0.0)
