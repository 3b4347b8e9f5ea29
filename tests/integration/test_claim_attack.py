"""A peer that claims every lost stage first and rebuilds none, and announces invented servers for
every stage, cannot block CheckFree (real daemons).

3 stages × 1 server, a spare and a trainer; an attacker (tests/helpers/attacker.py ``claim,serve``)
keeps a validly signed claim with time 0 on every stage, and a server record for every stage signed
by a key no daemon runs. When the middle stage is SIGKILLed, the spare does not count the invented
server (it answers no status probe), loses the claim to the attacker, waits one claim period, sees the
stage still unserved, ignores the attacker and rebuilds the stage from its neighbours; training goes on.
"""

import os
import signal
import time

from swarm.claims import CLAIM_TTL_S
from tests.helpers.swarm_utils import attacker_report, events, start_attacker, start_node

GRACE = 4.0
RECORD_TTL = 8.0
RUN = "claim-attack-test"
ARGS = ["--model", "micro", "--batch-size", "8", "--threads", "1", "--warmup-steps", "10", "--eval-batches", "2",
        "--stages", "3", "--sync-every", "8", "--eval-every", "2", "--run-id", RUN, "--recovery-grace", str(GRACE),
        "--averaging-timeout", "10", "--microbatches", "2"]


def test_a_peer_that_claims_every_stage_first_cannot_block_a_rebuild(tmp_path, nodes):
    boot = start_node(tmp_path, "st0", [*ARGS, "--role", "stage", "--stage", "0"])
    nodes.append(boot)
    addr = boot.multiaddr()
    for name, role in (("st1", ["--role", "stage", "--stage", "1"]), ("st2", ["--role", "stage", "--stage", "2"]),
                       ("spare", ["--role", "spare"]), ("trainer", ["--role", "trainer"])):
        nodes.append(start_node(tmp_path, name, [*ARGS, *role], [addr]))
    st0, st1, st2, spare, trainer = nodes
    attacker, report = start_attacker(tmp_path, addr, "--run-id", RUN, "--attacks", "claim,serve", "--stages", "3")
    nodes.append(attacker)
    liar = attacker_report(attacker, report, lambda found: found["passes"] >= 2)["peer_id"]
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
