"""Stopping and starting with real processes: a bootstrap peer that comes up late is waited for;
``node swarm`` sent SIGTERM stops every node it started; a node stops promptly whatever it is doing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from node.ops.launcher import free_port
from tests.helpers.swarm_utils import FAST_ARGS, alive, descendants, kill_group, start_node

ENV = {k: v for k, v in os.environ.items() if not k.startswith("LOCOMESH_")}


def test_a_bootstrap_peer_that_comes_up_later_is_waited_for(tmp_path, nodes):
    port = free_port()
    boot_args = FAST_ARGS + ["--identity", str(tmp_path / "boot.key"), "--listen", f"/ip4/127.0.0.1/tcp/{port}"]
    boot = start_node(tmp_path, "boot", boot_args + ["--max-steps", "3"])
    nodes.append(boot)
    assert boot.process.wait(timeout=120) == 0, boot.log()[-2000:]
    maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot.info()['peer_id']}"

    joiner = start_node(tmp_path, "joiner", FAST_ARGS + ["--join-timeout", "90"], [maddr])
    nodes.append(joiner)
    deadline = time.time() + 60
    while "bootstrap attempt 1 failed" not in joiner.log() and time.time() < deadline:
        time.sleep(0.5)
    time.sleep(1)  # still waiting after its first failed attempt, not exiting
    assert joiner.process.poll() is None, joiner.log()[-2000:]
    assert "bootstrap attempt 1 failed" in joiner.log() and maddr in joiner.log()
    boot_again = start_node(tmp_path, "boot", boot_args)  # same identity and port: the address the joiner was given
    nodes.append(boot_again)
    info = joiner.wait(lambda i: i.get("state") == "training", 120, "joining once the bootstrap peer is up")
    assert info["joined_round"] is not None, "it downloaded the state from the bootstrap peer"
    assert joiner.stop() == 0 and boot_again.stop() == 0


def test_swarm_sigterm_stops_every_node_and_writes_the_report(tmp_path):
    report = tmp_path / "report.json"
    swarm = subprocess.Popen([sys.executable, "-m", "node", "swarm", "--nodes", "2", "--duration", "300", "--report", str(report),
                              "--model", "nano", "--inner-steps", "10", "--batch-size", "8", "--eval-batches", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=ENV)
    try:
        deadline = time.time() + 150
        while time.time() < deadline:
            infos = [tmp_path / f"node{i}" / "info.json" for i in range(2)]
            if all(p.exists() and json.loads(p.read_text() or "{}").get("state") == "training" for p in infos):
                break
            assert swarm.poll() is None, swarm.stdout.read()[-3000:]
            time.sleep(0.5)
        else:
            raise AssertionError("the swarm's nodes did not start")
        started = descendants(swarm.pid)
        assert started
        sent = time.monotonic()
        swarm.send_signal(signal.SIGTERM)
        code = swarm.wait(timeout=60)
        took = time.monotonic() - sent
        output = swarm.stdout.read()
        assert code == 128 + signal.SIGTERM, output[-3000:]
        left = [pid for pid in started if alive(pid)]
        assert not left and took <= 15, f"{left} still running; the swarm took {took:.1f}s\n{output[-3000:]}"
        data = json.loads(report.read_text())
        assert any(e["event"] == "interrupted" and e.get("signal") == "SIGTERM" for e in data["events"])
        assert [n["exit_code"] for n in data["nodes"]] == [0, 0], "each node stopped cleanly: checkpoint written"
        assert all(Path(n["checkpoint"]).exists() for n in data["nodes"])
        # the report's shape (the full run to its --duration is test_swarm_command_writes_the_report, slow)
        assert data["config"]["model"] == "nano" and data["config"]["inner_steps"] == 10
        keys = {"peer_id", "exit_code", "steps", "outer_rounds", "train_loss_first", "train_loss_last", "val_loss",
                "bytes_sent", "bytes_received", "checkpoint", "multiaddrs", "metrics_port", "protocols"}
        for node in data["nodes"]:
            assert keys <= set(node) and node["role"] == "trainer" and node["multiaddrs"][0].startswith("/ip4/127.0.0.1/tcp/")
            assert set(node["protocols"]) - {"/locomesh/relay/1.0"} == {
                "/locomesh/average/1.0", "/locomesh/state/1.0", "/locomesh/status/1.0", "/locomesh/dialback/1.0",
                "/locomesh/relayed/1.0", "/locomesh/data/1.0"}
        assert [node["seed"] for node in data["nodes"]] == [0, 1], "each node draws its own data order"
        assert {"node_started", "bootstrap_ready", "node_exited", "joined"} <= {e["event"] for e in data["events"]}
        assert "swarm of 2 nodes" in output
    finally:
        if swarm.poll() is None:
            os.killpg(swarm.pid, signal.SIGKILL)
        for pid in descendants(swarm.pid) if swarm.poll() is None else []:
            os.kill(pid, signal.SIGKILL)


def test_a_node_stops_within_seconds_of_sigterm_during_codec_work(tmp_path, nodes):
    # an expensive codec on every round: rounds keep the codec busy most of the time
    node = start_node(tmp_path, "n", FAST_ARGS + ["--model", "tiny", "--inner-steps", "2", "--compression", "seed:r=64"])
    nodes.append(node)
    node.wait(lambda i: i.get("state") == "training", 120, "startup")
    node.wait(lambda i: i.get("outer_rounds", 0) >= 1 or "round 0" in node.log(), 120, "a first round")
    time.sleep(1.0)
    sent = time.monotonic()
    node.process.send_signal(signal.SIGTERM)
    code = node.process.wait(timeout=60)
    took = time.monotonic() - sent
    assert code == 0, node.log()[-2000:]
    assert took <= 10, f"stopped {took:.1f}s after SIGTERM"
    assert (tmp_path / "n" / "checkpoint.pt").exists()
    kill_group(node)
