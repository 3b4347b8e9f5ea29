"""A peer that claims every lost stage first and rebuilds none cannot block CheckFree (real daemons).

3 stages × 1 server, a spare and a trainer; an attacker (tests/helpers/attacker.py ``claim``) keeps a
validly signed claim with time 0 on every stage. When the middle stage is SIGKILLed, the spare loses
the claim to the attacker, waits one claim period, sees the stage still unserved, ignores the attacker
and rebuilds the stage from its neighbours; training goes on.
"""

import json
import os
import signal
import subprocess
import sys
import time

from swarm.claims import CLAIM_TTL_S
from tests.helpers.swarm_utils import NodeHandle, events, start_node

GRACE = 4.0
RECORD_TTL = 8.0
RUN = "claim-attack-test"
ARGS = ["--model", "micro", "--batch-size", "8", "--threads", "1", "--warmup-steps", "10", "--eval-batches", "2",
        "--stages", "3", "--sync-every", "8", "--eval-every", "0", "--run-id", RUN, "--recovery-grace", str(GRACE),
        "--averaging-timeout", "10", "--microbatches", "2"]


def _start_attacker(tmp_path, boot: str) -> tuple[NodeHandle, object]:
    folder = tmp_path / "attacker"
    folder.mkdir()
    report = folder / "report.json"
    log = open(folder / "log.txt", "w")
    process = subprocess.Popen([sys.executable, "-m", "tests.helpers.attacker", "--initial-peers", boot, "--run-id", RUN,
                                "--report", str(report), "--attacks", "claim", "--stages", "3"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return NodeHandle("attacker", folder, process, 0), report


def _attacker_id(handle: NodeHandle, report, timeout: float = 60) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            found = json.loads(report.read_text())
            if found["passes"] >= 2:
                return found["peer_id"]
        except (OSError, ValueError, KeyError):
            pass
        assert handle.process.poll() is None, f"the attacker exited:\n{handle.log()[-3000:]}"
        time.sleep(0.3)
    raise AssertionError(f"the attacker stored nothing in {timeout}s:\n{handle.log()[-3000:]}")


def test_a_peer_that_claims_every_stage_first_cannot_block_a_rebuild(tmp_path, nodes):
    boot = start_node(tmp_path, "st0", [*ARGS, "--role", "stage", "--stage", "0"])
    nodes.append(boot)
    addr = boot.multiaddr()
    for name, role in (("st1", ["--role", "stage", "--stage", "1"]), ("st2", ["--role", "stage", "--stage", "2"]),
                       ("spare", ["--role", "spare"]), ("trainer", ["--role", "trainer"])):
        nodes.append(start_node(tmp_path, name, [*ARGS, *role], [addr]))
    st0, st1, st2, spare, trainer = nodes
    attacker, report = _start_attacker(tmp_path, addr)
    nodes.append(attacker)
    liar = _attacker_id(attacker, report)
    trainer.wait(lambda i: i.get("steps", 0) >= 20, 240, "20 pipeline steps")

    os.killpg(st1.process.pid, signal.SIGKILL)
    killed_at = time.time()
    # record expiry + grace, one claim period lost to the liar, then the rebuild; plus polling slack
    deadline = killed_at + RECORD_TTL + GRACE + 2 * CLAIM_TTL_S + 30
    while time.time() < deadline and not events(spare, "stage_recovered"):
        assert attacker.process.poll() is None, attacker.log()[-2000:]
        time.sleep(0.5)
    recovered = events(spare, "stage_recovered")
    assert recovered and recovered[0]["stage"] == 1 and recovered[0]["method"] == "checkfree", spare.log()[-3000:]
    ignored = events(spare, "claim_ignored")
    assert ignored and ignored[0]["claimer"] == liar and ignored[0]["stage"] == 1, spare.log()[-3000:]
    assert "is being rebuilt by " + liar in spare.log(), "the liar did win the claim first"
    steps = trainer.info()["steps"]
    trainer.wait(lambda i: i.get("steps", 0) >= steps + 10, 120, "training after the rebuild")
    attacker.process.send_signal(signal.SIGTERM)
    attacker.process.wait(timeout=30)
    for node in (trainer, st0, st2, spare):
        assert node.stop() == 0, node.log()[-2000:]
