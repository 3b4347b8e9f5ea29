"""A DiLoCo round's rendezvous while its member keeps training (``--step-while-gathering``), and the requests that
tell a member its group is complete.

:class:`SteppingRendezvous` is a mixin of :class:`gossip.diloco.DiLoCoAverager` (it reads ``exchange``, ``_poke``,
``_gathering``, ``_on_asked`` and calls ``_choose_group``, ``_rendezvous`` and ``_publish``). A member that keeps
training registers first; θ follows once the group is complete, or as soon as another member asks for this
member's contribution: that member found the group complete and waits for this one. A request is only a hint (the
group is still what this member's own rendezvous reads): a stranger's request can end a member's stepping early for
one round, and nothing more. A round, ``rnd``, is ``gossip.diloco._Round``: typed ``Any`` here, since importing it
would make an import circle.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

import torch

from compression import ErrorFeedback
from gossip.outer import pseudo_gradient
from gossip.placement import to_host
from protocol.records import RoundEntry


@dataclass
class Handover:
    """θ of a round whose member kept training through the rendezvous (``DiLoCoAverager.run_round``'s ``later``):
    the weights (read in place: the member waits for the round), its samples, and when it stopped
    (``time.monotonic()``)."""

    theta: Sequence[torch.Tensor]
    samples: int
    at: float


class SteppingRendezvous:
    """The rendezvous steps of a round whose member registers first (a mixin: see the module's docstring)."""

    _gathering: int | None = None
    _on_asked: Callable[[], None] | None = None  # what else to tell when a member asks (run_round's ``asked``)
    _stepping: tuple[int, Callable[[], None]] | None = None  # (round, its hook) while θ of a stepping member is awaited
    _poke: asyncio.Event
    exchange: Any
    _choose_group: Callable[[Any], Awaitable[None]]  # (gossip.group_rendezvous.GroupedRendezvous)
    _rendezvous: Callable[[Any], Awaitable[list[RoundEntry]]]
    _publish: Callable[[Any, list[torch.Tensor], Sequence[ErrorFeedback | None] | None], Awaitable[None]]  # (DiLoCoAverager)

    async def _gather(self, rnd: Any, asked: Callable[[], None] | None) -> list[RoundEntry]:
        """The round's rendezvous; a member that asks for this round's contribution meanwhile (it found the group
        complete) brings its next poll forward and is passed on to ``asked``."""
        self._gathering, self._on_asked = rnd.number, asked
        try:
            return await self._rendezvous(rnd)
        finally:
            self._gathering, self._on_asked = None, None

    async def _gather_first(self, rnd: Any, before_gather: Callable[[], Awaitable[None]] | None,
                            later: Callable[[Sequence[RoundEntry]], Awaitable[Handover]],
                            feedback: Sequence[ErrorFeedback | None] | None,
                            asked: Callable[[], None] | None = None) -> list[RoundEntry]:
        """The rendezvous first, while this member keeps training; then θ (``later``), Δ and the contribution.
        θ is asked for once the group is complete (``later`` gets the group's entries), or as soon as a member asks
        for this contribution (it waits for this one; ``later`` gets none): Δ and the contribution are then made
        while the rendezvous still reads the DHT. A member that asks after the group was complete, while this one
        still steps (it waits for a slower member, ``node.replica.pacing``), is passed on to ``asked`` too.
        The round's times count from the hand-over, when the member stopped: its wait at the rendezvous is what
        it stood still (it reached the most steps it may take before the group was complete)."""
        await self._choose_group(rnd)
        rnd.wire = self.exchange.wire_of(rnd.number)
        if before_gather is not None:
            await before_gather()
        wanted = asyncio.Event()
        asked_at = math.inf

        def on_asked() -> None:
            nonlocal asked_at
            asked_at = min(asked_at, time.monotonic())
            wanted.set()
            if asked is not None:
                asked()

        gathering = asyncio.ensure_future(self._gather(rnd, on_asked))
        waiting = asyncio.ensure_future(wanted.wait())
        self._stepping = (rnd.number, on_asked)
        try:
            await asyncio.wait({gathering, waiting}, return_when=asyncio.FIRST_COMPLETED)
            handover = await later(gathering.result() if gathering.done() else [])  # (a rendezvous that failed ends the round here)
            rnd.samples, rnd.started = handover.samples, handover.at
            delta = await asyncio.to_thread(lambda: to_host(pseudo_gradient(rnd.phi, handover.theta)))
            del handover
            await self._publish(rnd, delta, feedback)
            group = await gathering
        finally:
            self._stepping = None
            waiting.cancel()
            gathering.cancel()
        # the group was complete for a member that asked: from then on this one's own reads are the exchange's time
        rnd.gathered = max(min(rnd.gathered, asked_at), rnd.started)
        return group

    def _asked(self, round_no: int) -> None:
        """A member asked for this node's contribution to ``round_no``: if that is the round it gathers, the member
        found the group complete, so the rendezvous polls at once (and ``run_round``'s ``asked`` hears of it); if this
        node's group of that round is complete and it still steps, ``asked`` hears of it."""
        if round_no == self._gathering:
            self._poke.set()
            if self._on_asked is not None:
                self._on_asked()
        elif self._stepping is not None and self._stepping[0] == round_no:
            self._stepping[1]()
