"""One peer's word cannot stop a zo newcomer: a record of another algorithm, or a meta with other
settings, makes the joiner skip that peer; it exits only when every trainer of the run disagrees."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from node.errors import JoinRefused
from node.zo.joiner import ZOJoiner


def _joiner(records: list[SimpleNamespace], refusing: set[str]) -> tuple[ZOJoiner, list[str]]:
    joiner = ZOJoiner.__new__(ZOJoiner)
    joiner.stop, joiner.join_timeout, joiner.run_id = threading.Event(), 0.0, "run"
    tried: list[str] = []

    def sync_from(peer: str, after_round: int | None = None) -> str:
        tried.append(peer)
        if peer in refusing:
            raise JoinRefused(f"run 'run' trains with --zo-lr 9 (this node: 0.01); {peer} says so")
        return "log"

    joiner._trainers = lambda: records  # type: ignore[method-assign]
    joiner.sync_from = sync_from  # type: ignore[method-assign]
    return joiner, tried


def _rec(peer: str, algorithm: str = "zo", round_no: int = 3) -> SimpleNamespace:
    return SimpleNamespace(peer_id=peer, algorithm=algorithm, round=round_no)


def test_a_record_of_another_algorithm_is_skipped_not_obeyed() -> None:
    joiner, tried = _joiner([_rec("liar", "diloco", 10**9), _rec("honest")], refusing=set())
    assert joiner.join() == ("honest", "log") and tried == ["honest"]


def test_a_peer_whose_meta_disagrees_is_skipped_for_the_next() -> None:
    joiner, tried = _joiner([_rec("liar", round_no=10**9), _rec("honest")], refusing={"liar"})
    assert joiner.join() == ("honest", "log") and tried == ["liar", "honest"]


def test_the_join_is_refused_when_every_trainer_disagrees() -> None:
    joiner, _ = _joiner([_rec("a", "diloco"), _rec("b", "sparseloco")], refusing=set())
    with pytest.raises(JoinRefused, match="--algorithm diloco, sparseloco"):
        joiner.join()
    joiner, tried = _joiner([_rec("a"), _rec("b")], refusing={"a", "b"})
    with pytest.raises(JoinRefused, match="--zo-lr 9"):
        joiner.join()
    assert sorted(tried) == ["a", "b"]


def test_a_peer_announcing_a_round_far_ahead_is_never_synced_with() -> None:
    joiner, tried = _joiner([_rec("liar", round_no=10**9), _rec("a"), _rec("b")], refusing=set())
    source, how = joiner.join()
    assert source in ("a", "b") and how == "log" and tried == [source]
