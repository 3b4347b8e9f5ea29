"""DiLoCo's and SparseLoCo's default H follows the replicas that average together (``--inner-steps by-replicas``): the table,
and a replica node sizing its next round from its last round's members (before any round: the trainers it
sees), while a number given with ``--inner-steps`` stays what it says."""

from __future__ import annotations

import pytest

from node.config import BY_REPLICAS, NodeConfig, steps_for_replicas
from node.config.defaults import STEPS_BY_REPLICAS
from node.replica.node import Daemon


def test_the_table_gives_every_replica_count_one_h() -> None:
    assert [steps_for_replicas(n) for n in (1, 2, 4)] == [50] * 3
    assert [steps_for_replicas(n) for n in (5, 8, 32, 10_000)] == [30] * 4
    for algorithm, table in STEPS_BY_REPLICAS.items():
        assert table[-1][0] is None  # any count has a row
        assert [steps_for_replicas(n, algorithm) for n in range(1, 40)] == sorted((steps_for_replicas(n, algorithm) for n in range(1, 40)), reverse=True)


def _daemon(**overrides) -> Daemon:
    d = Daemon(NodeConfig(model="nano", batch_size=4, device="cpu", threads=1, **overrides))
    d._prepare()
    return d


def _sees_trainers(d: Daemon, others: int) -> None:
    d.peer_rates = {d.summary.peer_id: 1.0, **{f"peer-{i}": 1.0 for i in range(others)}}


@pytest.mark.parametrize("fragments, per_round", [(1, (50, 30)), (2, (25, 15))])
def test_a_replica_sizes_its_round_from_the_replicas_that_averaged_last(fragments: int, per_round: tuple[int, int]) -> None:
    d = _daemon(fragments=fragments)
    assert d.cfg.inner_steps == BY_REPLICAS
    assert d._round_steps() == per_round[0]  # alone so far
    _sees_trainers(d, 5)
    assert d._round_steps() == per_round[1]  # six trainers in the records, no round yet
    d.last_contributors = 3  # the last round's members count, not the records (which anyone can add to)
    assert d._round_steps() == per_round[0]
    d.last_contributors = 8
    assert d._round_steps() == per_round[1]


def test_a_number_of_steps_given_is_kept_whatever_the_swarm() -> None:
    d = _daemon(inner_steps=40)
    _sees_trainers(d, 9)
    d.last_contributors = 10
    assert d._round_steps() == 40


def test_sparseloco_sizes_its_rounds_from_its_own_table() -> None:
    d = _daemon(algorithm="sparseloco")
    d.last_contributors = 2
    assert d._round_steps() == steps_for_replicas(2, "sparseloco")
    d.last_contributors = 8
    assert d._round_steps() == steps_for_replicas(8, "sparseloco")


def test_under_auto_steps_a_claimed_rate_of_1e30_cannot_push_a_peer_to_one_step() -> None:
    d = _daemon(inner_steps="auto")
    d.compute_tokens_per_s = 1000.0
    d.peer_rates = {d.summary.peer_id: 1000.0, "peer-1": 1000.0, "peer-2": 1000.0}
    honest = d._round_steps()
    assert honest == d.cfg.round_steps
    d.peer_rates["liar"] = 1e30  # one liar among three: the median moves by one rank at most
    assert d._round_steps() == honest
    d.peer_rates = {d.summary.peer_id: 1000.0, "liar": 1e30}  # alone with the liar: bounded by the clip of 20x
    assert d._round_steps() >= d.cfg.round_steps // 11 > 1
