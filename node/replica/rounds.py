"""Outer-round orchestration of a whole-model replica: start the round of the fragment that is due
(on the network thread, so training can go on with ``--overlap``), apply an eager estimate at once
(``--overlap-mode eager``), and wait for the round's result.

:class:`RoundRunner` owns the round in flight and the others' previous pseudo-gradients (for eager
updates); the daemon hands it the averager and the views of its weights and applies the result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import torch

from compression import ErrorFeedback
from gossip.diloco import DiLoCoAverager, Handover
from gossip.group_round import RoundResult
from gossip.wire_parts import PartSpec
from gossip.fragments import assign_fragments, fragment_of_round, merge_fragment
from gossip.noloco import NoLoCoAverager
from gossip.reduce_scatter import wire_partition
from gossip.placement import OuterPlacement
from protocol.records import RoundEntry
from node.runtime.network import Interrupted, NetworkThread


class RoundPlan:
    """What travels in each round: which parameters each fragment holds, the parts and codecs on the
    wire, and the error-feedback buffers of lossy codecs (one per part).

    :param names: parameter names in model order (fragments are dealt by block)
    :param shapes: their shapes
    :param codec: the pseudo-gradient codec; ``feedback_decay`` its error-feedback β (0: none)
    :param fragments: ``--fragments`` P; ``noloco``: members also send φ (near-lossless, since the pull
        toward the group's mean weights would turn a lossy codec's error into weight noise)
    """

    def __init__(self, *, names: list[str], shapes: list[tuple[int, ...]], codec: str, feedback_decay: float, fragments: int,
                 noloco: bool) -> None:
        self.codec, self.fragment_count, self.noloco = codec, fragments, noloco
        self.fragments = assign_fragments(names, fragments)
        self.partition = wire_partition(codec, shapes, noloco)  # finer for dense rounds: they may reduce-scatter
        self.parts = [self.partition.shapes([shapes[i] for i in fragment]) for fragment in self.fragments]
        self.feedback: list[list[ErrorFeedback] | None] = [
            [ErrorFeedback(feedback_decay) for _ in parts] if feedback_decay > 0 else None for parts in self.parts
        ]
        self.phi_codec = "none" if codec == "none" else "fp16"

    def wire(self) -> str:
        """Names everything that shapes the bytes of a round; members of a run must agree on it."""
        wire = self.codec
        if self.fragment_count > 1:
            wire += f"|fragments={self.fragment_count}"
        if self.partition.flat:
            wire += "|flat"
        if self.noloco:
            wire += f"|noloco:phi={self.phi_codec}"
        return wire

    def layout(self, round_no: int) -> list[PartSpec]:
        """The parts of round ``round_no`` and their codecs."""
        parts = self.parts[fragment_of_round(round_no, self.fragment_count)]
        specs = [PartSpec(shape, self.codec) for shape in parts]
        if self.noloco:
            specs += [PartSpec(shape, self.phi_codec) for shape in parts]
        return specs


@dataclass
class PendingRound:
    """An outer round running on the network thread while training goes on (``--overlap``)."""

    round: int
    fragment: int
    steps: int
    future: concurrent.futures.Future
    eager: list[torch.Tensor] | None = None  # the estimate of the fragment's new φ already applied (eager mode)
    start: list[torch.Tensor] | None = None  # θ when the round began, kept while training goes on beside it
    handover: "ThetaHandover | None" = None  # the round registered first: θ follows once the node stops stepping
    indices: list[int] | None = None  # (the fragment's parameters, for the hand-over)


class ThetaHandover:
    """θ of a round whose rendezvous runs while the training loop keeps stepping (``--step-while-gathering``):
    the round waits for :meth:`give` once its group is complete or a member waits for this node (``gathered`` is
    then set, and ``rates`` holds the speeds the group's members announced). ``asked`` is set when a member asked for
    this node's contribution: it found the group complete."""

    def __init__(self) -> None:
        self.gathered = threading.Event()
        self.asked = threading.Event()
        self.given = False
        self.rates: dict[str, float] = {}
        self._handover: concurrent.futures.Future = concurrent.futures.Future()

    async def __call__(self, group: Sequence[RoundEntry]) -> Handover:
        """On the network thread, once the group is complete (its entries) or a member asked (none): θ, once the
        training loop hands it over."""
        self.rates = {e.peer_id: e.tokens_per_s for e in group}
        self.gathered.set()
        return await asyncio.wrap_future(self._handover)

    def give(self, theta: list[torch.Tensor], samples: int) -> None:
        """From the training loop: θ (read in place: the loop now waits for the round) and the round's samples."""
        self.given = True
        if not self._handover.done():  # (a round cancelled as the node stops no longer waits for it)
            self._handover.set_result(Handover(theta, samples, time.monotonic()))


class RoundRunner:
    """Runs one outer round at a time.

    :param net: the node's network thread (the round's coroutine runs there)
    :param averager: DiLoCo/SparseLoCo or NoLoCo round logic
    :param eager: ``--overlap-mode eager``: step at once with an estimate, correct it when the result arrives
    :param before_gather: coroutine run before a round's rendezvous (the node's heartbeat)
    :param stop: the node's stop event (a wait is cut short when it is set)
    :param final_timeout: longest wait for the last round when the node stops
    :param placement: where φ lives (``--outer-device``); θ's snapshot of a round is copied there
    """

    def __init__(self, *, net: NetworkThread, averager: DiLoCoAverager | NoLoCoAverager, eager: bool,
                 before_gather: Callable[[], Awaitable[None]], stop: threading.Event, final_timeout: float,
                 placement: OuterPlacement | None = None) -> None:
        self.net, self.averager, self.eager = net, averager, eager
        self.placement = placement or OuterPlacement(torch.device("cpu"))
        self.before_gather, self.stop, self.final_timeout = before_gather, stop, final_timeout
        self.pending: PendingRound | None = None
        self.others_prev: dict[int, tuple[list[torch.Tensor], int]] = {}  # fragment → others' Σ samples·Δ, samples

    def start(self, round_no: int, fragment: int, indices: list[int], phi: list[torch.Tensor], params: list[torch.nn.Parameter],
              samples: int, steps: int, feedback: list | None, overlapped: bool = False, stepping: bool = False,
              due_at: float | None = None) -> PendingRound:
        """Start the round of ``fragment`` (parameters ``indices``); ``phi`` is the node's φ, stepped in place.
        ``overlapped``: training goes on while the round runs, so the round keeps θ's snapshot (``start``) for
        :func:`gossip.fragments.merge_fragment` (the snapshot the round sends from anyway: no extra copy).
        ``stepping``: the round registers at once and the training loop steps on until its group is complete
        (:meth:`gathered`), then hands θ over (:meth:`hand_over`) and waits for the round (DiLoCo rounds only);
        ``due_at``: when its budget runs out (``time.monotonic()``): a grace after a quorum counts from then at the earliest."""
        phi_fragment = [phi[i] for i in indices]
        if stepping:
            handover = ThetaHandover()
            coro = self.averager.run_round(round_no, phi_fragment, None, 0, before_gather=self.before_gather,  # type: ignore[call-arg]
                                           indices=indices, feedback=feedback, later=handover, asked=handover.asked.set,
                                           due_at=due_at)
            self.pending = PendingRound(round_no, fragment, steps, self.net.submit(coro), handover=handover, indices=indices)
            return self.pending
        # a blocking round reads θ in place: the training loop waits for it (eager rounds step θ at once)
        theta = self.placement.snapshot_of([params[i] for i in indices], kept_still=not overlapped and not self.eager)
        coro = self.averager.run_round(round_no, phi_fragment, theta, samples, before_gather=self.before_gather,
                                       indices=indices, feedback=feedback)
        estimate = None
        if self.eager and fragment in self.others_prev:
            # before the round touches φ and the outer momentum
            estimate = self._apply_eager(round_no, fragment, indices, phi_fragment, theta, params, samples)
        self.pending = PendingRound(round_no, fragment, steps, self.net.submit(coro), estimate,
                                    theta if overlapped and estimate is None else None)
        return self.pending

    def stepping(self) -> bool:
        """Whether a round's rendezvous runs while the training loop steps on (θ not handed over yet)."""
        return self.pending is not None and self.pending.handover is not None and not self.pending.handover.given

    def gathered(self) -> bool:
        """Whether that round's group is complete (or the round ended early): time to hand θ over once the budget is spent."""
        return self._handover_signalled(lambda h: h.gathered)

    def group_rates(self) -> dict[str, float]:
        """The speeds (tokens/s) the members of the stepping round's complete group announced (none before)."""
        pending = self.pending
        return {} if pending is None or pending.handover is None else pending.handover.rates

    def waited_for(self) -> bool:
        """Whether a member of that round waits for this node's θ (it asked for the contribution), or the round
        ended early: time to hand θ over, whatever is left of the budget."""
        return self._handover_signalled(lambda h: h.asked)

    def _handover_signalled(self, event: Callable[[ThetaHandover], threading.Event]) -> bool:
        pending = self.pending
        return pending is not None and pending.handover is not None and (event(pending.handover).is_set() or pending.future.done())

    def hand_over(self, params: list[torch.nn.Parameter], samples: int, steps: int) -> None:
        """The training loop stops: θ (read in place, the loop waits for the round now) and the round's samples and steps."""
        pending = self.pending
        assert pending is not None and pending.handover is not None and pending.indices is not None
        pending.steps = steps
        pending.handover.give(self.placement.snapshot_of([params[i] for i in pending.indices], kept_still=True), samples)

    def _apply_eager(self, round_no: int, fragment: int, indices: list[int], phi: list[torch.Tensor], theta: list[torch.Tensor],
                     params: list[torch.nn.Parameter], samples: int) -> list[torch.Tensor]:
        """Eager update: step at once with Δ̃ = (n_i·Δ_i + Σ_{j≠i} n_j·Δ_j(previous round)) / Σ n, this node's
        fresh pseudo-gradient standing in with the others' last ones; the true average corrects it later."""
        others_sum, others_samples = self.others_prev[fragment]
        total = samples + others_samples
        estimate = [(samples * (p.float() - t) + o.to(p.device)) / total for p, t, o in zip(phi, theta, others_sum)]
        phi_estimate = self.averager.outer.preview(phi, estimate, indices, round_no)  # type: ignore[union-attr]
        merge_fragment([params[i].data for i in indices], phi_estimate, 0.0)
        return phi_estimate

    def give_up(self) -> None:
        """Cancel the round in flight (the node stops while its round still gathers)."""
        if self.pending is not None:
            self.pending.future.cancel()
            self.pending = None

    def ready(self) -> bool:
        return self.pending is not None and self.pending.future.done()

    def running(self) -> bool:
        """Whether a round is in flight and has not ended yet."""
        return self.pending is not None and not self.pending.future.done()

    def wait(self, final: bool = False) -> tuple[RoundResult, PendingRound] | None:
        """Wait for the round in flight: (its result, the round), or None when none runs. Raises
        :class:`Interrupted` when the node is stopping (or, when ``final``, after ``final_timeout``)."""
        pending = self.pending
        if pending is None:
            return None
        waited = time.monotonic()
        try:
            while True:
                try:
                    result: RoundResult = pending.future.result(timeout=0.2)
                    break
                except concurrent.futures.TimeoutError:
                    late = final and time.monotonic() - waited > self.final_timeout
                    if (self.stop.is_set() and not final) or late:
                        pending.future.cancel()
                        raise Interrupted() from None
        finally:
            self.pending = None
        if result.in_sync and result.others_sum is not None:
            self.others_prev[pending.fragment] = (result.others_sum, result.others_samples)
        elif result.groups > 1:  # a bounded group averaged weights: no others' Δ to estimate the next round from
            self.others_prev.pop(pending.fragment, None)
        return result, pending

