"""Stage recovery decisions (``node.pipeline.recovery.StageRecoverer``) with the network replaced by callbacks:
who moves, the claim that makes one rebuilder per stage, retries instead of a fresh start, and the
line a pipeline short of nodes prints. The same code runs live in ``tests/integration/test_checkfree_swarm.py``."""

import time

import pytest

from node.runtime.metrics import NodeMetrics
from node.pipeline.recovery import FETCH_ATTEMPTS, StageRecoverer
from protocol.records import PeerRecord
from swarm.models.presets import preset
from swarm.stages import Stage

CFG = preset("micro")


def rec(peer: str, role: str, stage: int = -1, tps: float = 100.0) -> PeerRecord:
    return PeerRecord(peer_id=peer, role=role, stage=stage, tokens_per_s=tps)


class Harness:
    def __init__(self, records: list[PeerRecord], winner: str | None = None, failing_fetches: int = 0, stages: int = 3) -> None:
        self.records = {r.peer_id: r for r in records}
        self.winner, self.failing, self.stages = winner, failing_fetches, stages
        self.events: list[tuple[str, dict]] = []
        self.became: list[tuple[int, Stage]] = []
        self.fetches = 0
        self.fresh = 0
        self.claims: list[int] = []
        self.ignored: list[frozenset] = []
        self.me: str | None = None  # who wins a claim whose winner is ignored
        self.recoverer = StageRecoverer(stages=stages, model_cfg=CFG, seed=0, plus=True, grace=10.0, fetch_stage=self.fetch,
                                        new_stage=self.new_stage, become=self.become, claim=self.claim, refresh=lambda: dict(self.records), metrics=NodeMetrics(), event=self.event, sleep=lambda s: None)

    def fetch(self, index: int):
        self.fetches += 1
        if self.fetches <= self.failing:
            raise RuntimeError(f"no replica of stage {index} answered")
        return Stage(CFG, index, self.stages, 0, plus=True), self.records.get(f"s{index}")

    def new_stage(self, index: int) -> Stage:
        self.fresh += 1
        return Stage(CFG, index, self.stages, 0, plus=True)

    def become(self, index: int, module: Stage) -> None:
        self.became.append((index, module))

    def claim(self, stage: int, ignore: frozenset = frozenset()) -> str:
        self.claims.append(stage)
        self.ignored.append(ignore)
        return self.me if self.winner in ignore else self.winner

    def event(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def lose(self, stage: int) -> None:
        """Stage ``stage`` was served, then its servers vanished long ago."""
        self.recoverer.observe(dict(self.records))
        self.recoverer.last_served[stage] = time.monotonic() - 60.0
        self.records = {p: r for p, r in self.records.items() if not (r.role == "stage" and r.stage == stage)}
        self.recoverer.observe(dict(self.records))
        self.recoverer.last_served[stage] = time.monotonic() - 60.0


def test_spares_come_first_and_a_stage_s_last_server_never_moves():
    records = [rec("s0", "stage", 0), rec("s1a", "stage", 1, 50.0), rec("s1b", "stage", 1, 80.0), rec("s2", "stage", 2),
               rec("spare-b", "spare"), rec("spare-a", "spare")]
    h = Harness(records)
    h.recoverer.observe(h.records)
    assert h.recoverer.candidates("s0", "stage", 0, [2]) == ["spare-a", "spare-b", "s1a", "s1b"]
    no_spares = Harness([r for r in records if r.role != "spare"])
    no_spares.recoverer.observe(no_spares.records)
    assert no_spares.recoverer.candidates("s0", "stage", 0, [2]) == ["s1a", "s1b"], "slowest of the most replicated first"


def test_a_candidate_that_loses_the_claim_stays_where_it_is():
    records = [rec("s0", "stage", 0), rec("s1a", "stage", 1), rec("s1b", "stage", 1), rec("s2", "stage", 2)]
    loser = Harness(records, winner="s1a")
    loser.lose(2)
    assert loser.recoverer.check("s1b", "stage", 1) is False
    assert loser.claims == [2] and not loser.became and loser.fetches == 0
    assert loser.recoverer.check("s1b", "stage", 1) is False and loser.claims == [2], "it does not claim again while the claim lives"

    assert "claim_ignored" not in [e for e, _ in loser.events]

    winner = Harness(records, winner="s1b")
    winner.lose(2)
    assert winner.recoverer.check("s1b", "stage", 1) is True
    assert [i for i, _ in winner.became] == [2]
    assert [k for k, _ in winner.events] == ["stage_lost", "stage_recovered"]
    assert winner.events[-1][1]["method"] == "copy-plus"


def test_a_failed_copy_plus_is_retried_never_started_fresh():
    records = [rec("s0", "stage", 0), rec("s1", "stage", 1), rec("s2", "stage", 2), rec("me", "spare")]
    h = Harness(records, winner="me", failing_fetches=FETCH_ATTEMPTS + 1)
    h.lose(0)
    assert h.recoverer.check("me", "spare", None) is False, "every attempt failed: nothing changes"
    assert h.fresh == 0 and not h.became
    kinds = [k for k, _ in h.events]
    assert kinds == ["stage_lost", "stage_recovery_failed"] and "unrecoverable" not in str(h.events)
    h.recoverer.hold_off.clear()  # the retry delay has passed
    assert h.recoverer.check("me", "spare", None) is True
    assert h.fresh == 0 and [i for i, _ in h.became] == [0]
    assert h.events[-1][0] == "stage_recovered" and h.events[-1][1]["method"] == "copy-plus"
    assert h.events[-1][1]["attempts"] == 2, "the first attempt of the second try still failed"


def test_an_unrecoverable_stage_says_so_once_and_is_not_reported_recovered():
    records = [rec("s0", "stage", 0), rec("s1", "stage", 1), rec("s2", "stage", 2), rec("me", "spare")]
    h = Harness(records, winner="me")
    h.recoverer.plus = False
    h.lose(2)
    assert h.recoverer.check("me", "spare", None) is True
    kinds = [k for k, _ in h.events]
    assert kinds == ["stage_lost", "stage_unrecoverable"] and h.fresh == 1


def test_a_pipeline_short_of_nodes_names_the_missing_role_once(caplog):
    records = [rec("s0", "stage", 0), rec("s1", "stage", 1), rec("s2", "stage", 2), rec("t", "trainer")]
    h = Harness(records)
    h.lose(0)
    for _ in range(3):
        assert h.recoverer.check("s1", "stage", 1) is False
    shorts = [f for k, f in h.events if k == "pipeline_short"]
    assert shorts == [{"lost": [0], "missing": ["a server for stage 0"]}]
    assert caplog.text.count("pipeline short of nodes: it needs a server for stage 0") == 1
    assert not h.claims, "nobody who would empty a stage even claims"


def test_a_claimer_that_wins_and_never_rebuilds_is_ignored_after_a_claim_period():
    from swarm.claims import CLAIM_TTL_S, winner

    records = [rec("s0", "stage", 0), rec("s1a", "stage", 1), rec("s1b", "stage", 1), rec("s2", "stage", 2)]
    h = Harness(records, winner="liar")  # claims every lost stage with the earliest time, rebuilds nothing
    h.me = "s1b"
    h.lose(2)
    assert h.recoverer.check("s1b", "stage", 1) is False and h.ignored == [frozenset()]
    since = h.recoverer.won_by[2][1]
    h.recoverer.won_by[2] = ("liar", since - CLAIM_TTL_S)  # a claim period passed; the stage is still lost
    h.recoverer.hold_off[2] = 0.0
    assert h.recoverer.check("s1b", "stage", 1) is False, "the second loss to the same claimer only marks it"
    assert ("claim_ignored", {"stage": 2, "claimer": "liar", "unserved_for_s": pytest.approx(CLAIM_TTL_S, abs=1)}) in h.events
    assert h.recoverer.check("s1b", "stage", 1) is True, "the next check ignores it and rebuilds"
    assert h.ignored[-1] == frozenset({"liar"}) and h.became and h.became[0][0] == 2
    assert winner({"liar": 0.0, "s1b": 5.0}, ignore={"liar"}) == "s1b" and winner({"liar": 0.0}, ignore={"liar"}) is None


def test_a_winner_that_serves_the_stage_is_never_ignored():
    records = [rec("s0", "stage", 0), rec("s1a", "stage", 1), rec("s1b", "stage", 1), rec("s2", "stage", 2)]
    h = Harness(records, winner="s1a")
    h.lose(2)
    assert h.recoverer.check("s1b", "stage", 1) is False and 2 in h.recoverer.won_by
    h.recoverer.observe({**h.records, "s1a": rec("s1a", "stage", 2)})  # the winner serves the stage now
    assert 2 not in h.recoverer.won_by and not h.recoverer.ignored
