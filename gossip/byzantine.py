"""Attacks on averaging, for experiments: what a hostile peer sends instead of its honest update.

``node swarm --byzantine 'I:ATTACK[,ATTACK]'`` makes node I an attacker (never a default; the node
says so in its log), and ``benchmarks.byzantine`` runs every attack against every aggregator. An
attack rewrites one contribution: the update Δ a peer sends and the sample count it claims.

- ``samples``: claims 10⁹ samples with its honest update.
- ``scale:K``: sends K·Δ (default K = 50).
- ``sign``: sends −Δ.
- ``noise``: Gaussian noise with the norm of its honest update.
- ``alie``: "A little is enough" (Baruch, Baruch, Goldberg, NeurIPS 2019): μ − z·σ per coordinate,
  μ and σ the mean and spread of the honest updates (the exchange is open, so an attacker can read
  them); z = 1 by default (``alie:Z``).
- ``ipm``: inner-product manipulation (Xie, Koyejo, Gupta, UAI 2020): −ε·μ (ε = 0.5, ``ipm:E``).
- ``stale``: replays the update it sent ``lag`` rounds ago (5 by default, ``stale:L``).
- ``concentrate``: for sparse payloads: the whole norm of its update on a few coordinates (the
  first 1 % of each tensor) pushed the wrong way.

Two attacks leave the update alone and abuse the protocol around it (a modified peer inside the swarm):

- ``cap``: announces an upload cap of 10⁻³⁰⁰ Mbit/s (``LYING_UP_MBIT``) in its rendezvous entries and
  records, so that every member would wait ~10³⁰² s for its update.
- ``future``: at each of its rounds, asks every member for its contributions to the next
  ``FUTURE_ROUNDS`` rounds, holding the requests open (they once filled every member's wait pool).
- ``relayed``: at each of its rounds, opens relayed streams to every member, each naming a made-up origin
  and asking for the whole state (``gossip.relay_flood``): per-client limits keyed on the origin once
  never bound them.
- ``state``: serves joiners its φ with the sign flipped (:func:`served_params`), announcing the swarm's
  round; a joiner that took the first peer it ranked (ties once went to the lowest id, which is free to
  grind) adopted it.

One attack is a pipeline trainer's (``--role trainer``; a stage replica takes the others, ``samples``
above all):

- ``activations:K``: from its ``ATTACK_AFTER_MICROBATCHES``-th microbatch on (once the servers' scale
  checks know the honest scale), the trainer multiplies the activations it sends to stages 1 … S−1 by
  K (10⁶ by default), so stage servers see implausible inputs in a row (they once made a server's
  shared scale check forget its scale).

Where the honest updates are not known (a live attacker that has not read the round yet), ``alie``
and ``ipm`` take the attacker's own honest update for μ and the spread of its own last updates for σ.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

ATTACKS = ("samples", "scale", "sign", "noise", "alie", "ipm", "stale", "concentrate", "cap", "future", "relayed", "state",
           "activations")
PROTOCOL_ATTACKS = ("cap", "future", "relayed", "state", "activations")  # they leave the update alone
TRAINER_ATTACKS = ("activations",)  # a pipeline trainer's; the others are a replica's or a stage replica's
LYING_UP_MBIT = 1e-300
FUTURE_ROUNDS = 16
ATTACK_AFTER_MICROBATCHES = 50
DEFAULT_PARAM = {"scale": 50.0, "alie": 1.0, "ipm": 0.5, "stale": 5.0, "activations": 1e6}
MAX_STALE_LAG = 15  # the attacker keeps its last 16 updates: a longer lag silently became "sign"
LYING_SAMPLES = 10**9


def parse_attacks(spec: str) -> list[tuple[str, float | None]]:
    """``"scale:20,samples"`` → ``[("scale", 20.0), ("samples", None)]``; a clear error for anything else."""
    out = []
    for part in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = part.partition(":")
        if name not in ATTACKS:
            raise ValueError(f"unknown attack {name!r}; choose from {', '.join(ATTACKS)}")
        if value and name not in DEFAULT_PARAM:
            raise ValueError(f"attack {name!r} takes no parameter (got {part!r})")
        try:
            param = float(value) if value else DEFAULT_PARAM.get(name)
        except ValueError:
            raise ValueError(f"attack {part!r}: {value!r} is not a number") from None
        if param is not None and not math.isfinite(param):
            raise ValueError(f"attack {part!r}: the parameter must be finite")
        if name == "stale" and (param != int(param) or not 1 <= param <= MAX_STALE_LAG):  # type: ignore[operator]
            raise ValueError(f"attack {part!r}: the lag must be a whole number of rounds from 1 to {MAX_STALE_LAG}")
        out.append((name, param))
    if not out:
        raise ValueError("no attack given; e.g. scale:50 or sign,samples")
    return out


def announced_up_mbit(spec: str | None, honest: float) -> float:
    """The upload cap a node with attacks ``spec`` (None: none) announces: its ``honest`` one, or the
    ``cap`` attack's lie."""
    return LYING_UP_MBIT if spec and any(name == "cap" for name, _ in parse_attacks(spec)) else honest


def served_params(phi: Sequence[torch.Tensor], attacker: "Attacker | None") -> list[torch.Tensor]:
    """A CPU copy of φ as a node serves it to joiners: as it is, or, under the ``state`` attack, sign-flipped."""
    out = [t.to("cpu", copy=True) for t in phi]
    return [t.neg_() for t in out] if attacker is not None and attacker.does("state") else out


def _norm(update: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.float().pow(2).sum()) for t in update))


@dataclass
class Attacker:
    """One hostile peer: rewrites each of its contributions by its attacks, in the order given.

    :param attacks: from :func:`parse_attacks`
    :param seed: seed of its noise
    """

    attacks: list[tuple[str, float | None]]
    seed: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=MAX_STALE_LAG + 1))

    def __post_init__(self) -> None:
        self._gen = torch.Generator().manual_seed(self.seed)

    def describe(self) -> str:
        return ",".join(name if p is None else f"{name}:{p:g}" for name, p in self.attacks)

    @classmethod
    def from_spec(cls, spec: str | None, seed: int = 0) -> "Attacker | None":
        """The attacker of ``--attack SPEC`` (None without one: never a default), saying so in the log."""
        if spec is None:
            return None
        attacker = cls(parse_attacks(spec), seed=seed)
        logger.warning("this node ATTACKS the swarm: it sends %s instead of its honest update (--attack, an experiment)",
                       attacker.describe())
        return attacker

    def does(self, name: str) -> bool:
        """Whether ``name`` is among this attacker's attacks."""
        return any(n == name for n, _ in self.attacks)

    def param(self, name: str) -> float | None:
        """The parameter of attack ``name`` (None: not among its attacks, or it takes none)."""
        return next((p for n, p in self.attacks if n == name), None)

    def contribution(self, delta: Sequence[torch.Tensor], samples: int,
                     honest: Sequence[Sequence[torch.Tensor]] | None = None) -> tuple[list[torch.Tensor], int]:
        """What this attacker sends instead of ``delta`` and ``samples``.

        :param honest: the honest updates of the round, where the attacker could read them
        """
        own = [t.detach().to(torch.float32).clone() for t in delta]
        self.history.append([t.clone() for t in own])
        out = own
        for name, param in self.attacks:
            if name == "samples":
                samples = LYING_SAMPLES
            elif name == "scale":
                out = [t * float(param) for t in out]
            elif name == "sign":
                out = [-t for t in out]
            elif name == "noise":
                norm = _norm(out)
                noise = [torch.randn(t.shape, generator=self._gen) for t in out]
                scale = norm / max(_norm(noise), 1e-30)
                out = [z * scale for z in noise]
            elif name in ("alie", "ipm"):
                mean, std = self._honest_stats(honest)
                out = ([m - float(param) * s for m, s in zip(mean, std)] if name == "alie"
                       else [-float(param) * m for m in mean])
            elif name == "stale":
                lag = int(param)
                out = [t.clone() for t in self.history[-1 - lag]] if len(self.history) > lag else [-t for t in out]
            elif name == "concentrate":
                out = [_concentrate(t) for t in out]
        return out, samples

    def _honest_stats(self, honest: Sequence[Sequence[torch.Tensor]] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Coordinate mean and spread of the honest updates, or of this attacker's own recent ones."""
        pool = [list(u) for u in honest] if honest else [list(u) for u in self.history]
        stacked = [torch.stack([u[i].to(torch.float32) for u in pool]) for i in range(len(pool[0]))]
        mean = [s.mean(dim=0) for s in stacked]
        std = [s.std(dim=0, unbiased=False) if len(pool) > 1 else s[0].abs() for s in stacked]
        return mean, std


def _concentrate(t: torch.Tensor) -> torch.Tensor:
    """The tensor's whole norm on its first 1 % of coordinates (at least one), against their sign."""
    flat = t.flatten()
    k = max(1, flat.numel() // 100)
    out = torch.zeros_like(flat)
    norm = float(flat.norm())
    head = flat[:k]
    direction = -torch.sign(head)
    direction[direction == 0] = -1.0
    out[:k] = direction * (norm / math.sqrt(k))
    return out.view_as(t)
