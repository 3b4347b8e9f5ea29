"""Fault injection for local swarms (``node swarm --chaos SPEC``): which node to SIGKILL, and when."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChaosAction:
    """One fault to inject (``node swarm --chaos SPEC``): SIGKILL a stage's servers, one node, or a
    random node, once at ``at`` seconds or every ``every`` seconds."""

    target: str  # "stage", "node" or "random"
    value: int | None
    at: float | None
    every: float | None
    next_t: float = 0.0

    def __post_init__(self) -> None:
        self.next_t = self.at if self.at is not None else (self.every or 0.0)


def parse_chaos(spec: str) -> ChaosAction:
    """``kill:stage=1:at=60s``, ``kill:node=2:at=30``, ``kill:random:every=45s``."""
    parts = spec.split(":")
    if len(parts) < 3 or parts[0] != "kill":
        raise ValueError(f"--chaos {spec!r}: expected kill:stage=S:at=T, kill:node=I:at=T or kill:random:every=T")
    target, value = parts[1].partition("=")[0], parts[1].partition("=")[2]
    if target not in ("stage", "node", "random") or (target != "random" and not value.isdigit()):
        raise ValueError(f"--chaos {spec!r}: the victim is stage=S, node=I or random")
    timing: dict[str, float] = {}
    for part in parts[2:]:
        key, _, raw = part.partition("=")
        if key not in ("at", "every"):
            raise ValueError(f"--chaos {spec!r}: unknown field {key!r} (use at=T or every=T)")
        try:
            timing[key] = float(raw.removesuffix("s"))
        except ValueError:
            raise ValueError(f"--chaos {spec!r}: {key} needs seconds, e.g. {key}=60s") from None
        if timing[key] <= 0:
            raise ValueError(f"--chaos {spec!r}: {key} must be positive")
    if len(timing) != 1:
        raise ValueError(f"--chaos {spec!r}: give exactly one of at=T or every=T")
    return ChaosAction(target, int(value) if value else None, timing.get("at"), timing.get("every"))
