"""Exchange of one-byte zeroth-order codes over ``/locomesh/zo/1.0``: a round's code sets, relays of
code sets another member failed to fetch, and the log of applied rounds for joiners.

Requests (each one stream, one reply):

- ``get {run, n, p: []}``: the server's own code set of round n (it waits up to its serve timeout
  until it has finished the round's steps). Reply ``codes {n, at, s: [["", fp, codes]], a}`` (the
  server is the owner, so its peer id is left out) with ``at`` the round the server is in. A server
  past round n has applied it already; ``a = [members, after]`` then says what it applied: an
  8-byte digest of the sorted peer ids whose sets it applied, and the fingerprint it reached. A
  requester that would apply other members replays the server's log instead (it came late), so all
  take exactly the same round. ``s`` is empty once the server dropped its codes (``KEEP_SETS``).
- ``get {run, n, p: [peer, ...]}``: a relay: the code sets of those members of round n that the
  server fetched itself (it first waits until its own direct fetches of round n are done, never
  for its relays, so two members asking each other cannot wait on each other). Reply
  ``codes {n, s: [[peer, fp, codes], ...]}`` with whatever it holds.
- ``log {run, from: k}``: the server's position and the applied rounds from k on. Reply
  ``log {n, t, f, meta, e: [[round, fp_before, fp_after, [[peer, fp, codes], ...]], ...]}`` with
  n the round it is in, t its steps into it, f the fingerprint of its weights at the start of round
  n, and the entries contiguous and below n.

Fingerprints travel as the 12 raw bytes of ``gossip.fingerprint``; codes as raw ``int8`` bytes,
one per step. Relayed code sets are not signed: a relay that alters one makes the members that
used it drift, which the next round's fingerprint vote finds (they resync).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from gossip.failures import failure_reason
from gossip.fingerprint import fingerprint
from gossip.zo import apply_codes, expand, unpack_codes
from protocol import ids
from protocol.errors import ProtocolError, SchemaError
from protocol.frames import FramedStream, require
from protocol.hivemind_transport import Transport

logger = logging.getLogger(__name__)
KEEP_SETS = 4  # rounds of code sets kept for relays and late fetchers
FP_BYTES = 12


@dataclass(frozen=True)
class CodeSet:
    """One member's codes of one round, with the fingerprint of the weights it evaluated them at."""

    peer: str
    round: int
    fingerprint: str  # hex, of θ at the start of the round
    codes: bytes  # int8 per step; step t is byte t


@dataclass(frozen=True)
class LogEntry:
    """One applied round: the weights' fingerprints before and after, and the code sets applied."""

    round: int
    before: str
    after: str
    sets: tuple[CodeSet, ...]


@dataclass(frozen=True)
class Position:
    """Where a member is: its round, its steps into it, and the fingerprint of the round's weights."""

    round: int
    step: int
    fingerprint: str


@dataclass
class Gathered:
    """A round's code sets as one member fetched them, and the rounds members had already applied."""

    sets: dict[str, CodeSet]
    failures: dict[str, str]  # peer → why its codes are missing ("relayed": they came through another member)
    ahead: dict[str, "Applied"]  # peer → what it applied, for members already past this round


@dataclass(frozen=True)
class Applied:
    """How a member that is past a round applied it: the digest of its members, the fingerprint reached."""

    at: int  # the round it is in now
    members: bytes | None  # None when it no longer logs the round
    after: str | None


def members_digest(peers: Iterable[str]) -> bytes:
    """8 bytes naming the set of members whose codes a round applied."""
    return hashlib.blake2b("|".join(sorted(peers)).encode(), digest_size=8).digest()


@dataclass
class LogReply:
    position: Position
    meta: dict[str, Any]
    entries: list[LogEntry]


def _fp_bytes(fp: str) -> bytes:
    return bytes.fromhex(fp)


def _fp_hex(value: Any, what: str) -> str:
    if not isinstance(value, bytes) or len(value) != FP_BYTES:
        raise SchemaError(f"{what}: a fingerprint must be {FP_BYTES} bytes")
    return value.hex()


def _set_wire(s: CodeSet, owner: bool = False) -> list[Any]:
    return ["" if owner else s.peer, _fp_bytes(s.fingerprint), s.codes]


def _entry_wire(e: LogEntry) -> list[Any]:
    return [e.round, _fp_bytes(e.before), _fp_bytes(e.after), [_set_wire(s) for s in e.sets]]


def _entry_from_wire(item: Any, max_steps: int) -> LogEntry:
    if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], int) and isinstance(item[3], list)):
        raise SchemaError("a log entry must be [round, before, after, sets]")
    sets = tuple(_set_from_wire(s, item[0], None, max_steps) for s in item[3])
    return LogEntry(item[0], _fp_hex(item[1], "log entry"), _fp_hex(item[2], "log entry"), sets)


def _set_from_wire(item: Any, round_no: int, owner: str | None, max_steps: int) -> CodeSet:
    if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[2], bytes)):
        raise SchemaError("a code set must be [peer, fingerprint, codes]")
    peer = owner if owner is not None else item[0]
    if not peer:
        raise SchemaError("a relayed code set must name its peer")
    if len(item[2]) > max_steps:
        raise SchemaError(f"code set of {peer} holds {len(item[2])} steps, more than {max_steps}")
    try:
        unpack_codes(item[2])
    except ValueError as e:
        raise SchemaError(str(e)) from None
    return CodeSet(peer, round_no, _fp_hex(item[1], f"code set of {peer}"), item[2])


class CodeExchange:
    """Serves and fetches one-byte code sets and the applied-round log of one member.

    :param transport: the node's protocol transport
    :param run_id: only requests for this run are served
    :param position: this member's :class:`Position` (called on the network thread: keep it cheap)
    :param meta: settings every member must share (sent with the log, checked by joiners)
    :param serve_timeout: how long a request may wait for this member's codes or direct fetches
    :param keep_log: applied rounds kept for joiners (entries since the last snapshot are never dropped)
    :param max_steps: the most codes a set may hold (larger ones are refused)
    """

    def __init__(self, transport: Transport, run_id: str, position: Callable[[], Position], meta: dict[str, Any],
                 serve_timeout: float = 30.0, keep_log: int = 16, max_steps: int = 1_000_000) -> None:
        self.transport, self.run_id, self.position, self.meta = transport, run_id, position, meta
        self.serve_timeout, self.keep_log, self.max_steps = serve_timeout, keep_log, max_steps
        self._lock = threading.Lock()  # the log and the sets are written from the training thread
        self._sets: dict[int, dict[str, CodeSet]] = {}
        self._own: dict[int, CodeSet] = {}
        self._log: dict[int, LogEntry] = {}
        self._events: dict[tuple[str, int], asyncio.Event] = {}
        self.served: dict[int, set[str]] = {}  # round → peers that fetched our own codes

    async def start(self) -> None:
        await self.transport.serve(ids.ZO, self._handle)

    def _event(self, kind: str, round_no: int) -> asyncio.Event:
        return self._events.setdefault((kind, round_no), asyncio.Event())

    # ---- what this member holds --------------------------------------------------------------
    async def publish(self, own: CodeSet) -> None:
        """Make this member's codes of ``own.round`` available (run on the network loop)."""
        with self._lock:
            self._own[own.round] = own
            self._sets.setdefault(own.round, {})[own.peer] = own
            for old in [r for r in self._sets if r <= own.round - KEEP_SETS]:
                self._sets.pop(old, None)
                self._own.pop(old, None)
                self.served.pop(old, None)
                for kind in ("own", "direct"):
                    self._events.pop((kind, old), None)
        self._event("own", own.round).set()

    def record(self, entry: LogEntry, snapshot_round: int) -> None:
        """Log an applied round; keeps the last ``keep_log`` rounds and every round since ``snapshot_round``."""
        with self._lock:
            self._log[entry.round] = entry
            floor = min(entry.round + 1 - self.keep_log, snapshot_round)
            for old in [r for r in self._log if r < floor]:
                del self._log[old]

    def reset_log(self) -> None:
        """Forget the log (after adopting a downloaded state, older entries no longer lead to our weights)."""
        with self._lock:
            self._log.clear()

    def entries_from(self, first: int, below: int) -> list[LogEntry]:
        """Logged rounds first, first + 1, ... below ``below``, stopping at the first gap."""
        out = []
        with self._lock:
            r = first
            while r < below and r in self._log:
                out.append(self._log[r])
                r += 1
        return out

    # ---- serving -----------------------------------------------------------------------------
    async def _handle(self, stream: FramedStream) -> None:
        msg = await stream.recv(expect=("get", "log"))
        if require(msg.body, "run", str) != self.run_id:
            raise SchemaError(f"this node trains run {self.run_id!r}, not {msg.body['run']!r}")
        if msg.kind == "log":
            first = require(msg.body, "from", int)
            pos = self.position()  # before the entries: every entry returned lies below pos.round
            entries = self.entries_from(max(first, 0), pos.round)
            await stream.send("log", {
                "n": pos.round, "t": pos.step, "f": _fp_bytes(pos.fingerprint), "meta": self.meta,
                "e": [_entry_wire(e) for e in entries],
            })
            return
        round_no = require(msg.body, "n", int)
        wanted = require(msg.body, "p", list)
        if not all(isinstance(p, str) for p in wanted) or len(wanted) > 1024:
            raise SchemaError("'p' must list at most 1024 peer ids")
        kind = "direct" if wanted else "own"
        current = self.position().round
        if round_no > current + 1 or round_no < 0:
            raise SchemaError(f"round {round_no} is not served (this node is at round {current})")
        if round_no < current and not wanted:  # past it: its codes while it keeps them, and what it applied
            with self._lock:
                own = self._own.get(round_no)
                self.served.setdefault(round_no, set()).add(stream.peer)
            sets = [_set_wire(own, owner=True)] if own is not None else []
            await stream.send("codes", {"n": round_no, "at": current, "s": sets, **self._applied(round_no)})
            return
        try:
            await asyncio.wait_for(self._event(kind, round_no).wait(), timeout=self.serve_timeout)
        except asyncio.TimeoutError:
            if not wanted:
                raise SchemaError(f"no codes for round {round_no} within {self.serve_timeout:.0f}s") from None
        body: dict[str, Any] = {"n": round_no, "at": self.position().round}
        with self._lock:
            if not wanted:
                own = self._own.get(round_no)
                if own is None:
                    raise SchemaError(f"no codes for round {round_no}")
                self.served.setdefault(round_no, set()).add(stream.peer)
                body["s"] = [_set_wire(own, owner=True)]
                body.update(self._applied(round_no))
            else:
                held = self._sets.get(round_no, {})
                body["s"] = [_set_wire(held[p]) for p in wanted if p in held]
        await stream.send("codes", body)

    def _applied(self, round_no: int) -> dict[str, Any]:
        entry = self._log.get(round_no)
        if entry is None:
            return {}
        return {"a": [members_digest(s.peer for s in entry.sets), _fp_bytes(entry.after)]}

    # ---- fetching ----------------------------------------------------------------------------
    async def _request(self, peer: str, kind: str, body: dict[str, Any], expect: str) -> dict[str, Any]:
        stream = await self.transport.open(peer, ids.ZO)
        try:
            await stream.send(kind, {"run": self.run_id, **body})
            return (await stream.recv(expect=expect)).body
        finally:
            self.transport.account(ids.ZO, stream)
            await stream.close()

    async def fetch(self, peer: str, round_no: int, whose: Sequence[str] = ()) -> tuple[list[CodeSet], Applied]:
        """``peer``'s own code set of ``round_no`` (``whose`` empty; none when it dropped them) or the
        code sets of ``whose`` it holds (a relay), and where ``peer`` is (what it applied if past the round)."""
        body = await self._request(peer, "get", {"n": round_no, "p": list(whose)}, "codes")
        if require(body, "n", int) != round_no:
            raise SchemaError(f"asked for round {round_no}, got {body['n']}")
        at = require(body, "at", int)
        items = require(body, "s", list)
        if not whose and (len(items) > 1 or not items and at <= round_no):
            raise SchemaError(f"expected this peer's code set, got {len(items)}")
        sets = [_set_from_wire(item, round_no, None if whose else peer, self.max_steps) for item in items]
        if whose and any(s.peer not in whose for s in sets):
            raise SchemaError("relay answered with code sets nobody asked for")
        applied = body.get("a")
        if applied is None:
            return sets, Applied(at, None, None)
        if not (isinstance(applied, list) and len(applied) == 2 and isinstance(applied[0], bytes) and len(applied[0]) == 8):
            raise SchemaError("'a' must be [8-byte members digest, fingerprint]")
        return sets, Applied(at, applied[0], _fp_hex(applied[1], "applied round"))

    async def gather(self, members: Sequence[str], round_no: int, timeout: float) -> Gathered:
        """Every member's code set of ``round_no``: fetched from the member itself, else relayed by a
        member that fetched it; and the round as applied by members that were done with it."""

        async def direct(peer: str) -> tuple[list[CodeSet], Applied]:
            return await asyncio.wait_for(self.fetch(peer, round_no), timeout)

        results = await asyncio.gather(*(direct(p) for p in members), return_exceptions=True)
        got: dict[str, CodeSet] = {}
        ahead: dict[str, Applied] = {}
        failures: dict[str, str] = {}
        for peer, result in zip(members, results):
            if isinstance(result, tuple):
                got.update({s.peer: s for s in result[0]})
                if result[1].at > round_no:
                    ahead[peer] = result[1]
            else:
                failures[peer] = failure_reason(result, f"fetching zo codes from {peer}")
                logger.info("round %d: no codes from %s (%s: %s)", round_no, peer, type(result).__name__, result)
        self._store(round_no, got)
        self._event("direct", round_no).set()
        for helper in sorted(got):
            missing = [p for p in members if p not in got and p not in ahead]
            if not missing:
                break
            try:
                relayed, _ = await asyncio.wait_for(self.fetch(helper, round_no, missing), timeout)
            except Exception as e:
                logger.info("round %d: relay %s failed: %s", round_no, helper, e)
                continue
            for s in relayed:
                got[s.peer] = s
                failures[s.peer] = "relayed"
        self._store(round_no, got)
        return Gathered(got, {p: why for p, why in failures.items() if p not in got or why == "relayed"}, ahead)

    def _store(self, round_no: int, sets: dict[str, CodeSet]) -> None:
        with self._lock:
            self._sets.setdefault(round_no, {}).update(sets)

    async def fetch_log(self, peer: str, first: int) -> LogReply:
        """``peer``'s position, shared settings and applied rounds from ``first`` on (contiguous)."""
        body = await self._request(peer, "log", {"from": first}, "log")
        pos = Position(require(body, "n", int), require(body, "t", int), _fp_hex(body.get("f"), "log position"))
        entries: list[LogEntry] = []
        for item in require(body, "e", list):
            entry = _entry_from_wire(item, self.max_steps)
            if entries and entry.round != entries[-1].round + 1 or entry.round >= pos.round:
                raise SchemaError("log entries must be contiguous and below the peer's round")
            entries.append(entry)
        return LogReply(pos, require(body, "meta", dict), entries)


class ReplayError(Exception):
    """A logged round does not continue the weights it is applied to, or gives other weights."""


def replay(params: Sequence[torch.Tensor], entries: Sequence[LogEntry], round_no: int, fp: str, run_id: str,
           lr: float, pool: int = 0) -> Iterator[LogEntry]:
    """Apply the logged rounds from ``round_no`` on to ``params`` (whose fingerprint is ``fp``), yielding
    each entry once applied and checked; raises :class:`ReplayError` at the first entry that does not
    start from the weights reached so far or does not end at its logged fingerprint."""
    for entry in entries:
        if entry.round < round_no:
            continue
        if entry.round != round_no or entry.before != fp:
            raise ReplayError(f"the log's round {entry.round} does not continue weights {fp} of round {round_no}")
        apply_codes(params, [m for s in entry.sets for m in expand(entry.round, s.peer, s.codes)], run_id, lr, pool=pool)
        fp = fingerprint(params)
        if fp != entry.after:
            raise ReplayError(f"replaying round {entry.round} gave weights {fp}, the log says {entry.after}")
        round_no += 1
        yield entry
