"""A rebuild whose source is briefly unreachable is retried, never started fresh (live processes).

Two stages with --checkfree-plus: one server each, a spare and a trainer. Stage 0's server is
SIGKILLed; before the stage counts as lost, stage 1's only server is frozen (SIGSTOP: a laptop that
went to sleep), so its record expires and the spare's copy-plus of stage 0 from stage 1 finds no
replica. The spare must report ``stage_recovery_failed`` and keep stage 0 unserved rather than start it
from a fresh initialisation. Once stage 1's server wakes up (SIGCONT) the spare's next try copies stage
0 from it, and the trainer goes on.

Timing (record TTL 8 s, heartbeats every 2 s, grace G = 40 s): stage 0 counts as lost 4–8 s + G after
the kill; freezing stage 1 at kill + 33 s makes its record expire by kill + 41 s, before the spare's
first try (≥ kill + 45 s), and stage 1 itself would count as lost only at kill + 33 + 4 + G = kill +
77 s, long after the test wakes it (as soon as the failed try is reported, about kill + 55 s).
"""

import os
import signal
import time

import pytest

from tests.helpers.swarm_utils import NodeHandle, events as _events, start_node

GRACE = 40.0
FREEZE_AFTER_KILL_S = 33.0
ARGS = ["--model", "micro", "--batch-size", "8", "--threads", "1", "--warmup-steps", "10", "--eval-batches", "4",
        "--stages", "2", "--sync-every", "8", "--eval-every", "2", "--run-id", "checkfree-retry", "--checkfree-plus",
        "--recovery-grace", str(GRACE), "--averaging-timeout", "10", "--microbatches", "2"]


@pytest.mark.slow  # about 2 minutes, most of it the 40 s grace: `make test-slow`
def test_a_copy_plus_whose_source_sleeps_is_retried_not_started_fresh(tmp_path, nodes):
    st0 = start_node(tmp_path, "st0", [*ARGS, "--role", "stage", "--stage", "0"])
    nodes.append(st0)
    addr = st0.multiaddr()
    for name, role in (("st1", ["--role", "stage", "--stage", "1"]), ("spare", ["--role", "spare"]),
                       ("trainer", ["--role", "trainer"])):
        nodes.append(start_node(tmp_path, name, [*ARGS, *role], [addr]))
    _, st1, spare, trainer = nodes
    trainer.wait(lambda i: len([r for r in i.get("rounds", []) if "val_loss" in r]) >= 2, 240, "two evaluations")

    os.killpg(st0.process.pid, signal.SIGKILL)
    killed_at = time.time()
    time.sleep(FREEZE_AFTER_KILL_S)
    os.kill(st1.process.pid, signal.SIGSTOP)
    try:
        spare.wait(lambda i: any(e["event"] == "stage_recovery_failed" for e in i.get("events", [])),
                   killed_at + GRACE + 40 - time.time(), "a failed copy-plus while stage 1 sleeps")
        assert not _events(spare, "stage_recovered"), "nothing to copy from while stage 1 sleeps"
    finally:
        os.kill(st1.process.pid, signal.SIGCONT)
    woke_at = time.time()
    assert woke_at - killed_at < FREEZE_AFTER_KILL_S + 4 + GRACE - 5, "woke stage 1 before it counted as lost"

    spare.wait(lambda i: any(e["event"] == "stage_recovered" for e in i.get("events", [])), 60, "the retried copy-plus")
    failed, recovered = _events(spare, "stage_recovery_failed"), _events(spare, "stage_recovered")
    assert [e["stage"] for e in failed] == [0] * len(failed) and failed[0]["method"] == "copy-plus", failed
    assert "no replica of stage 1" in failed[0]["error"], failed
    assert len(recovered) == 1 and recovered[0]["stage"] == 0 and recovered[0]["method"] == "copy-plus", recovered
    assert recovered[0]["from_stage"] == 1
    for node in (spare, st1, trainer):
        assert not _events(node, "stage_unrecoverable"), node.info().get("events")
        assert not [e for e in _events(node, "stage_lost") if e["stage"] == 1], "stage 1 was never lost"
    steps = trainer.info()["steps"]
    trainer.wait(lambda i: i.get("steps", 0) >= steps + 20, 120, "training through the rebuilt stage 0")
    for node in (trainer, st1, spare):
        assert node.stop() == 0, node.log()[-2000:]


def _rebuilt_stage_0(*candidates: NodeHandle, timeout: float) -> tuple[NodeHandle, dict]:
    """The node that reported rebuilding stage 0 first, and its event (a bounded poll of every candidate)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for node in candidates:
            done = [e for e in _events(node, "stage_recovered") if e["stage"] == 0]
            if done:
                return node, done[0]
        time.sleep(0.3)
    raise AssertionError("no node rebuilt stage 0 within {:.0f}s: {}".format(
        timeout, {n.name: n.info().get("events") for n in candidates}))


def test_a_newcomer_to_an_emptied_stage_rebuilds_it_instead_of_starting_fresh(tmp_path, nodes):
    """Stage 0's only server dies and a new node joins at once, before anyone declares the stage lost:
    the run has trained, so stage 0 is copied from stage 1 (CheckFree+) rather than served from the run's
    initialisation next to a trained stage 1. Usually the newcomer rebuilds it as it joins; when the
    killed server's record still looked alive, the newcomer joins stage 1 beside st1 and one of those two
    rebuilds stage 0 once it counts as lost (the slower of them; both are idle without a stage 0)."""
    args = [*ARGS, "--recovery-grace", "6"]
    st0 = start_node(tmp_path, "st0", [*args, "--role", "stage", "--stage", "0"])
    nodes.append(st0)
    addr = [st0.multiaddr()]
    st1 = start_node(tmp_path, "st1", [*args, "--role", "stage", "--stage", "1"], addr)
    trainer = start_node(tmp_path, "trainer", [*args, "--role", "trainer"], addr)
    nodes.extend([st1, trainer])
    addr = [st1.multiaddr()]
    trainer.wait(lambda i: len([r for r in i.get("rounds", []) if "val_loss" in r]) >= 3, 240, "three evaluations")
    before = [r["val_loss"] for r in trainer.info()["rounds"] if "val_loss" in r][-1]

    os.killpg(st0.process.pid, signal.SIGKILL)
    newcomer = start_node(tmp_path, "newcomer", [*args, "--role", "auto"], addr)
    nodes.append(newcomer)
    rebuilder, recovered = _rebuilt_stage_0(newcomer, st1, timeout=120)
    assert recovered["method"] == "copy-plus" and recovered["from_stage"] == 1, recovered
    # the newcomer may first have joined stage 1 beside st1 (st0's record was still alive): copied from a replica, fine
    fresh = [e for e in _events(newcomer, "stage_joined") if not e.get("source")]
    assert not fresh, f"no stage served from the run's initialisation: {fresh}"
    steps = trainer.info()["steps"]
    trainer.wait(lambda i: len([r for r in i.get("rounds", []) if "val_loss" in r and r["step"] > steps]) >= 1, 120,
                 "an evaluation through the rebuilt stage")
    after = [r["val_loss"] for r in trainer.info()["rounds"] if "val_loss" in r and r["step"] > steps][0]
    # a fresh stage 0 (random embeddings) before a trained stage 1 evaluates near the uniform 5.5 nats
    assert after < before + 0.5, (before, after, rebuilder.name, [(r["step"], round(r["val_loss"], 3))
                                  for r in trainer.info()["rounds"] if "val_loss" in r],
                                  {n.name: n.info().get("events") for n in (newcomer, st1)})
    for node in (newcomer, st1, trainer):
        assert not _events(node, "stage_unrecoverable"), node.info().get("events")
    for node in (trainer, st1, newcomer):
        assert node.stop() == 0, node.log()[-2000:]
