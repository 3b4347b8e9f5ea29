"""Modified peers inside a live pipeline (2 stages): a stage-1 replica that claims 10⁹ samples at every
stage round, and a trainer that multiplies the activations it sends to stage 1 by 10⁶. The honest
trainer keeps training (its loss falls, no step fails after the start), the stage-1 replicas still
agree after the rounds they average together (each caps the claim alike: 8 × the round's lower-median
claim), and stage-1 servers refuse the liar's inputs without forgetting the honest scale."""

from tests.helpers.swarm_utils import start_node

PIPE = ["--model", "nano", "--batch-size", "8", "--threads", "1", "--warmup-steps", "10", "--eval-batches", "4",
        "--stages", "2", "--sync-every", "6", "--eval-every", "2", "--run-id", "hostile-pipe", "--averaging-timeout", "10"]


def test_a_lying_stage_replica_and_a_trainer_sending_huge_activations_do_not_stop_the_pipeline(tmp_path, nodes):
    boot = start_node(tmp_path, "s0", [*PIPE, "--role", "stage", "--stage", "0"])
    nodes.append(boot)
    addr = [boot.multiaddr()]
    for name, role in (("s1a", ["--role", "stage", "--stage", "1"]),
                       ("s1z", ["--role", "stage", "--stage", "1", "--attack", "samples"]),
                       ("t0", ["--role", "trainer", "--seed", "1"]),
                       ("tz", ["--role", "trainer", "--seed", "2", "--attack", "activations"])):
        nodes.append(start_node(tmp_path, name, [*PIPE, *role], addr))
    s0, s1a, s1z, t0, tz = nodes

    def joint_rounds():
        a = {r["round"]: r for r in s1a.info().get("rounds", [])}
        return [(a[r["round"]], r) for r in s1z.info().get("rounds", [])
                if r["round"] in a and r["contributors"] == a[r["round"]]["contributors"] == 2 and r["in_sync"] and a[r["round"]]["in_sync"]]

    t0.wait(lambda i: i.get("steps", 0) >= 60, 300, "60 honest pipeline steps")
    s1a.wait(lambda i: bool(joint_rounds()), 180, "a stage-1 round both replicas averaged")
    s1a.wait(lambda i: i.get("refused_implausible", 0) + s1z.info().get("refused_implausible", 0) >= 3, 120,
             "the attacking trainer's activations refused")
    assert "this node ATTACKS the swarm" in s1z.log() and "this node ATTACKS the swarm" in tz.log()
    assert all(x["fingerprint"] == y["fingerprint"] for x, y in joint_rounds()), joint_rounds()
    before = t0.info()["steps"]
    t0.wait(lambda i: i.get("steps", 0) >= before + 30, 180, "30 more honest steps beside the attackers")
    for node in (t0, tz, s0, s1a, s1z):  # trainers first: a pipeline without stage servers cannot step
        node.stop()
    info = t0.info()
    assert info["train_loss_last"] < info["train_loss_first"] - 0.5, info
    assert tz.info().get("steps", 0) < info["steps"] / 2, "the attacker's steps went through"
