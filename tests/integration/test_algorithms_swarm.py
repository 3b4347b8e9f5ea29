"""NoLoCo, SparseLoCo and streaming DiLoCo with real daemons on loopback.

- 4 NoLoCo daemons (one joining late) train without a global barrier: every round averages at most
  2 members, and the joiner downloads state and joins the others' rounds;
- a NoLoCo peer SIGKILLed mid-run costs its partner at most one rendezvous deadline per round;
- SparseLoCo, streaming DiLoCo with overlap (asap), eager and delayed overlap average live: the
  replicas agree after every round both averaged, and each mode shows what it promises.
"""

import os
import signal

import pytest

from node.config import steps_for_replicas
from swarm.models.presets import preset
from tests.helpers.swarm_utils import FAST_ARGS, start_node

NOLOCO = [*FAST_ARGS, "--algorithm", "noloco", "--eval-every", "2"]


def _rounds(info):
    return info.get("rounds", [])


@pytest.mark.slow  # 35 s; NoLoCo's pairing runs live in make test through the partner-killed test
def test_noloco_four_peers_average_in_pairs_and_a_joiner_catches_up(tmp_path, nodes):
    run = ["--run-id", "noloco-four"]
    first = start_node(tmp_path, "n0", [*NOLOCO, *run, "--seed", "0"])
    nodes.append(first)
    boot = first.multiaddr()
    for i in (1, 2):
        nodes.append(start_node(tmp_path, f"n{i}", [*NOLOCO, *run, "--seed", str(i)], [boot]))
    for node in nodes[1:]:
        node.wait(lambda i: len(_rounds(i)) >= 2, 120, "two rounds")
    joiner = start_node(tmp_path, "n3", [*NOLOCO, *run, "--seed", "3"], [boot])
    nodes.append(joiner)
    joined = joiner.wait(lambda i: i.get("joined_round") is not None, 120, "a state download")
    assert joined["joined_round"] >= 2, "the joiner starts at the swarm's round, not at 0"
    for node in nodes:
        node.wait(lambda i: sum(r["contributors"] == 2 for r in _rounds(i)) >= 4, 180, "four paired rounds")
    for node in nodes:
        assert node.stop() == 0, node.log()[-2000:]
    infos = [node.info() for node in nodes]
    for info in infos:
        sizes = [r["contributors"] for r in _rounds(info)]
        assert sizes and max(sizes) <= 2, f"a NoLoCo group must not exceed 2 members, saw {sizes}"
        assert info["train_loss_last"] < 3.5 and info["val_loss"] < 3.5, info
    # replicas are distinct (no global average) yet close: the gossip keeps them together
    fingerprints = {info["rounds"][-1]["fingerprint"] for info in infos}
    assert len(fingerprints) > 1
    joiner_rounds = _rounds(infos[3])
    assert joiner_rounds[0]["round"] >= joined["joined_round"]


def test_noloco_partner_killed_mid_run_costs_at_most_one_deadline(tmp_path, nodes):
    run = ["--run-id", "noloco-kill", "--averaging-timeout", "10"]
    a = start_node(tmp_path, "a", [*NOLOCO, *run, "--seed", "0"])
    nodes.append(a)
    b = start_node(tmp_path, "b", [*NOLOCO, *run, "--seed", "1"], [a.multiaddr()])
    nodes.append(b)
    a.wait(lambda i: sum(r["contributors"] == 2 for r in _rounds(i)) >= 3, 120, "three paired rounds")
    os.killpg(b.process.pid, signal.SIGKILL)
    killed_at = len(_rounds(a.info()))
    info = a.wait(lambda i: len(_rounds(i)) >= killed_at + 4, 120, "four rounds after the kill")
    assert a.stop() == 0
    after = _rounds(info)[killed_at:]
    for r in after:
        # the rendezvous gives up at the deadline; a fetch from the dead peer fails fast
        assert r["gather_s"] <= r["deadline_s"] + 3.0, r
        assert r["duration_s"] <= r["deadline_s"] + 10.0 + 3.0, r
    assert all(r["contributors"] == 1 for r in after[2:]), "alone once the dead peer's record expired"
    assert info["steps"] > 0 and info["train_loss_last"] < 4.0


# Each mode of the replica daemon, live with 2 nodes: ``make test`` runs a few rounds of each, ``make
# test-slow`` the same checks over more rounds and with a held-out loss target.
MODES = {
    "sparse": ["--algorithm", "sparseloco", "--inner-steps", "by-replicas"],  # its table's H in steps (auto paces it by time)
    "stream": ["--fragments", "2", "--overlap", "--inner-steps", "20"],  # overlap asap
    "eager": ["--overlap", "--overlap-mode", "eager", "--inner-steps", "10"],
    "delayed": ["--overlap", "--overlap-mode", "delayed"],
}
JUMPS = ("caught_up", "resynced", "out_of_sync", "joined")  # a node's progress into the round jumps there


def _run_pair(tmp_path, nodes, mode: str, rounds: int) -> list[dict]:
    """Two nodes in ``mode`` until each has averaged ``rounds`` rounds with the other; their infos."""
    run = ["--run-id", f"algo-{mode}", "--eval-every", "1"]
    a = start_node(tmp_path, f"{mode}0", [*FAST_ARGS, *MODES[mode], *run, "--seed", "0"])
    nodes.append(a)
    b = start_node(tmp_path, f"{mode}1", [*FAST_ARGS, *MODES[mode], *run, "--seed", "1"], [a.multiaddr()])
    nodes.append(b)
    for node in (a, b):
        node.wait(lambda i: sum(r["contributors"] == 2 for r in _rounds(i)) >= rounds, 150, f"{rounds} rounds of 2")
    assert a.stop() == 0 and b.stop() == 0
    return [a.info(), b.info()]


def _settled_joint_rounds(infos: list[dict]) -> list[tuple[dict, dict]]:
    """The rounds both nodes averaged together, in sync, after the last state jump of either (a joiner's
    first round may start from a state downloaded mid-round and be voted out once)."""
    last_jump = max((e["t"] for info in infos for e in info["events"] if e["event"] in JUMPS), default=0.0)
    by_round = [{r["round"]: r for r in _rounds(info) if r["contributors"] == 2 and r["in_sync"] and r["t"] > last_jump}
                for info in infos]
    return [(by_round[0][n], by_round[1][n]) for n in sorted(set(by_round[0]) & set(by_round[1]))]


def _regular_rounds(info: dict) -> list[dict]:
    """The rounds of a node that follow another round with no state jump between them: a node that caught up
    with its peer (or resynced) takes over the peer's progress into the round, so the round after that is
    legitimately shorter; every other round takes the node's H (H/P with fragments)."""
    jumps = [e["t"] for e in info["events"] if e["event"] in JUMPS]
    rs = _rounds(info)
    # a round's record time is rounded to the millisecond, so the event of its own end (out_of_sync) may read earlier
    return [r for prev, r in zip(rs, rs[1:]) if not any(prev["t"] - 0.001 <= t <= r["t"] for t in jumps)]


def _check_mode(mode: str, infos: list[dict], rounds: int) -> None:
    a, b = infos
    settled = _settled_joint_rounds(infos)
    assert len(settled) >= rounds - 3, (len(settled), [(r["round"], r["contributors"], r["in_sync"]) for r in _rounds(a)])
    for ra, rb in settled:  # the round averaged both: the replicas hold the same φ after it
        assert ra["fingerprint"] == rb["fingerprint"], (mode, ra, rb)
    for info in infos:
        assert info["comm_wait_s"] < info["wall_s"], info  # wait is part of the run, not all of it
        assert info["val_loss"] < a["train_loss_first"] - 1.5, ("trained far below the untrained loss", info)
    if mode == "sparse":
        # top-k + 2-bit payloads of the nano model are a few kB (dense fp32: 482 kB)
        sent = [ra["average_bytes_sent"] for ra, _ in settled]
        assert 0 < sum(sent) / len(sent) < 20_000, sent
        # the averaged rounds go on lowering the held-out loss
        assert settled[-1][0]["val_loss"] < settled[0][0]["val_loss"], [ra["val_loss"] for ra, _ in settled]
        # H by replica count: two replicas take the table's H for two (rounds after a state jump may be shorter)
        regular = _regular_rounds(a)
        assert len(regular) >= 2 and all(r["steps"] == steps_for_replicas(2, "sparseloco") for r in regular), \
            [(r["round"], r["steps"], r["contributors"]) for r in _rounds(a)]
    elif mode == "stream":
        assert [ra["fragment"] for ra, _ in settled] == [ra["round"] % 2 for ra, _ in settled], "fragments take turns"
        assert {ra["fragment"] for ra, _ in settled} == {0, 1}
        regular = _regular_rounds(a)
        # a round is due every H/P = 10 steps; while the round before it still runs the node steps on, up to twice that
        assert len(regular) >= 2 and all(10 <= r["steps"] <= 20 for r in regular), \
            f"a round every H/P = 10 steps or more: {[(r['round'], r['steps']) for r in _rounds(a)]}"
    elif mode == "delayed":
        # a round's result is applied when the next round starts, so at a multiple of H = 15 steps, H after
        # the round before it (asap would apply a quick round a step or two after it began). Rounds after a
        # state jump are left out: when the joiner arrives mid-run, the first node may be voted out of sync
        # once (a legitimate resync) and its next round starts afresh; the last round is applied at the stop.
        tokens_per_step = 8 * preset("nano").context
        regular = [r for r in _regular_rounds(a)[:-1] if r["steps"] == 15]
        steps = [r["tokens"] // tokens_per_step for r in regular]
        assert len(regular) >= 4, _rounds(a)
        assert all(s % 15 == 0 for s in steps), [(r["round"], s) for r, s in zip(regular, steps)]
        pairs = [(s1, s2) for r1, r2, s1, s2 in zip(regular, regular[1:], steps, steps[1:]) if r2["round"] == r1["round"] + 1]
        assert pairs and all(s2 - s1 == 15 for s1, s2 in pairs), [(r["round"], s) for r, s in zip(regular, steps)]


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_averages_live(mode, tmp_path, nodes):
    """SparseLoCo, streaming fragments with overlap (asap), eager and delayed overlap: ~12 s each."""
    _check_mode(mode, _run_pair(tmp_path, nodes, mode, rounds=5), rounds=5)


@pytest.mark.slow  # 25 s each: `make test-slow`
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_averages_for_longer(mode, tmp_path, nodes):
    infos = _run_pair(tmp_path, nodes, mode, rounds=15)
    _check_mode(mode, infos, rounds=15)
    assert all(info["val_loss"] < 3.5 for info in infos), infos


AUTO_OVERLAP = ["--auto-overlap", "--min-peers", "2", "--inner-steps", "20", "--max-upload-mbit", "2", "--max-download-mbit", "2"]
VERDICTS = ("overlap_kept", "overlap_off")


def test_auto_overlap_turns_overlap_on_where_rounds_block_and_judges_it_by_speed(tmp_path, nodes):
    """--auto-overlap on a capped link, where a dense nano round (~0.5 MB each way at 2 Mbit/s) takes far longer
    than its 20 inner steps (both wait for each other before the first step, so every round is a pair's): each node
    starts blocking, turns overlap on after three costly rounds, judges it by its
    steps per second over three more and keeps or drops it; the replicas stay bit-identical throughout."""
    run = ["--run-id", "algo-auto-overlap", "--eval-every", "2"]
    a = start_node(tmp_path, "auto0", [*FAST_ARGS, *AUTO_OVERLAP, *run, "--seed", "0"])
    nodes.append(a)
    boot = a.wait(lambda i: i.get("state") == "waiting" and i.get("multiaddrs"), 90, "startup")["multiaddrs"][0]
    b = start_node(tmp_path, "auto1", [*FAST_ARGS, *AUTO_OVERLAP, *run, "--seed", "1"], [boot])
    nodes.append(b)
    for node in (a, b):
        node.wait(lambda i: any(e["event"] in VERDICTS for e in i.get("events", [])), 240, "overlap judged by speed")
    assert a.stop() == 0 and b.stop() == 0
    infos = [a.info(), b.info()]
    for info in infos:
        chosen = [e for e in info["events"] if e["event"] in ("overlap_on", *VERDICTS)]
        assert [e["event"] for e in chosen][:1] == ["overlap_on"] and chosen[1]["event"] in VERDICTS, chosen
        on, verdict = chosen[0], chosen[1]
        assert on["blocked_share"] >= 0.10 and on["round"] >= 4, on  # after the start-up round and three measured ones
        assert verdict["round"] >= on["round"] + 3, verdict
        assert verdict["blocked_share"] < verdict["blocking_blocked_share"], ("overlapped rounds blocked less", verdict)
        kept = verdict["speed_gain"] >= verdict["needed_gain"]
        assert (verdict["event"] == "overlap_kept") == kept, verdict
        assert info["overlap"] == ("on" if kept else "off"), info["overlap"]
        assert info["val_loss"] < info["train_loss_first"] - 1.5, ("trained far below the untrained loss", info)
    settled = _settled_joint_rounds(infos)
    assert len(settled) >= 4, [(r["round"], r["contributors"], r["in_sync"]) for r in _rounds(infos[0])]
    for ra, rb in settled:  # blocking, overlapped or switching between them, a round both averaged leaves one φ
        assert ra["fingerprint"] == rb["fingerprint"], (ra, rb)


def test_settings_mismatch_names_every_difference():
    from node.runtime.settings import settings_mismatch

    mine = {"model": "nano", "algorithm": "noloco", "compression": "none", "fragments": 1}
    assert settings_mismatch(mine, dict(mine)) is None
    assert settings_mismatch(mine, {}) is None  # an older peer's state carries no settings
    swarm = {**mine, "algorithm": "diloco", "compression": "q4"}
    assert settings_mismatch(mine, swarm) == "--algorithm diloco (this node: noloco), --compression q4 (this node: none)"


def test_a_joiner_with_other_settings_is_told_what_to_change(tmp_path, nodes):
    run = ["--run-id", "algo-mismatch"]
    a = start_node(tmp_path, "a", [*FAST_ARGS, *run])
    nodes.append(a)
    b = start_node(tmp_path, "b", [*FAST_ARGS, *run, "--algorithm", "noloco"], [a.multiaddr()])
    nodes.append(b)
    assert b.process.wait(timeout=120) == 3
    assert "trains with --algorithm diloco (this node: noloco)" in b.log()
    assert a.process.poll() is None, "the swarm is unaffected"
    assert a.stop() == 0
