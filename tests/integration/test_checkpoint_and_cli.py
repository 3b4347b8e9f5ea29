"""Checkpoints are atomic; `node swarm` writes the documented report; CLI errors are clear."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.checkpoints import checkpoint
from tests.helpers import zygote


def test_atomic_save_keeps_the_previous_checkpoint_when_a_write_dies(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic({"round": 1, "w": torch.ones(3)}, path)

    def dying_save(obj, f):
        f.write(b"partial garbage")
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_atomic({"round": 2, "w": torch.zeros(3)}, path)
    monkeypatch.undo()
    state = checkpoint.load(path)
    assert state["round"] == 1 and torch.equal(state["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"], "no temp file left behind"


def test_corrupt_checkpoint_is_reported_not_fatal(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert checkpoint.newest_valid(tmp_path) is None
    with pytest.raises(ValueError, match="not a readable locomesh checkpoint"):
        checkpoint.load(tmp_path / "checkpoint.pt")


class Evil:
    """Any class outside torch's weights-only allow-list."""


def test_checkpoints_refuse_pickled_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": Evil()}, path)
    with pytest.raises(ValueError):
        checkpoint.load(path)


def test_eval_of_missing_checkpoint_is_a_clear_error(tmp_path):
    out = zygote.run(["eval", "--checkpoint", str(tmp_path / "nope.pt")],
                         timeout=120)
    assert out.returncode == 2 and "no checkpoint at" in out.stderr


def test_swarm_command_runs_to_its_duration_trains_and_writes_the_report(tmp_path):
    """The `make demo` path (`node swarm` to its --duration, nano instead of tiny, 2 nodes): ~40 s. `node swarm`
    passes --min-peers: node 0 waits for node 1 before its first step (it used to train alone and leave). The
    duration counts from when both daemons are up (start-up took 35 s once on a loaded 2-core machine)."""
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "node", "swarm", "--nodes", "2", "--duration", "30", "--report", str(report),
         "--model", "nano", "--inner-steps", "10", "--batch-size", "8", "--eval-batches", "2"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert set(data) >= {"duration_s", "config", "nodes", "events"}
    assert data["config"]["model"] == "nano" and data["config"]["inner_steps"] == 10
    keys = {"peer_id", "exit_code", "steps", "outer_rounds", "train_loss_first", "train_loss_last", "val_loss",
            "bytes_sent", "bytes_received", "checkpoint", "multiaddrs", "metrics_port", "protocols"}
    assert len(data["nodes"]) == 2
    for node in data["nodes"]:
        assert keys <= set(node)
        assert node["role"] == "trainer" and node["stage"] is None and node["resumed_from"] is None
        assert node["exit_code"] == 0 and node["steps"] > 0
        # it trained: rounds averaged, and the held-out loss is below each node's first loss and well below
        # the untrained one (ln 256 = 5.55)
        assert node["outer_rounds"] >= 3 and node["bytes_sent_by_kind"].get("average", 0) > 0, node
        rounds = json.loads((tmp_path / f"node{node['index']}" / "info.json").read_text())["rounds"]
        assert sum(r["contributors"] == 2 and r["in_sync"] for r in rounds) >= 2, "the two nodes averaged together"
        info = json.loads((tmp_path / f"node{node['index']}" / "info.json").read_text())
        assert rounds[0]["contributors"] == 2, ("both from the first round: the start-up barrier", rounds[:2])
        assert any(e["event"] == "peers_ready" and e["peers"] == 2 for e in info["events"]), info["events"]
        # (node 1 joins with node 0's trained weights: its first loss is already lower)
        assert node["val_loss"] < node["train_loss_first"] and node["val_loss"] < data["nodes"][0]["train_loss_first"] - 1.5, node
        assert Path(node["checkpoint"]).is_file()
        # the node 0 relays for peers behind NAT; every node answers dial-backs and relayed streams, and says where its data channel is
        assert set(node["protocols"]) - {"/locomesh/relay/1.0"} == {
            "/locomesh/average/1.0", "/locomesh/state/1.0", "/locomesh/status/1.0", "/locomesh/dialback/1.0",
            "/locomesh/relayed/1.0", "/locomesh/data/1.0"}
        assert node["multiaddrs"] and node["multiaddrs"][0].startswith("/ip4/127.0.0.1/tcp/")
    assert [node["seed"] for node in data["nodes"]] == [0, 1], "each node draws its own data order"
    kinds = {e["event"] for e in data["events"]}
    assert {"node_started", "bootstrap_ready", "sigterm", "node_exited", "joined"} <= kinds
    assert "swarm of 2 nodes" in out.stdout
    assert "waiting for --min-peers 2 before the first step: 1 in run" in (tmp_path / "node0" / "log.txt").read_text()
    progress = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert progress and all(len(line) <= 120 for line in progress), "plain progress: one short line per node"


def test_swarm_rejects_bad_join_options(tmp_path):
    out = zygote.run(["swarm", "--nodes", "2", "--model", "huge"],
                         timeout=60)
    assert out.returncode == 2 and "unknown model preset 'huge'" in out.stderr


def test_restarted_node_resumes_from_its_checkpoint(tmp_path):
    from tests.helpers.swarm_utils import FAST_ARGS, start_node

    first = start_node(tmp_path, "n", FAST_ARGS + ["--max-steps", "31"])
    assert first.process.wait(timeout=120) == 0, first.log()[-2000:]
    before = first.info()
    assert before["outer_rounds"] == 2 and before["checkpoint"]
    saved = checkpoint.load(before["checkpoint"])
    assert saved["round"] == 2 and saved["inner_steps_total"] == 31

    again = start_node(tmp_path, "n", FAST_ARGS + ["--max-steps", "15"])
    assert again.process.wait(timeout=120) == 0, again.log()[-2000:]
    after = again.info()
    resumed = [e for e in after["events"] if e["event"] == "resumed"]
    assert resumed and resumed[0]["round"] == 2
    assert after["rounds"][0]["round"] == 2, "training continued at the checkpoint's round"
    assert after["train_loss_first"] < before["train_loss_first"] - 1.0, "weights came back, not a fresh init"


def test_a_checkpoint_of_other_settings_is_refused_and_fresh_moves_it_aside(tmp_path):
    from tests.helpers.swarm_utils import FAST_ARGS, start_node

    first = start_node(tmp_path, "n", FAST_ARGS + ["--max-steps", "16"])
    assert first.process.wait(timeout=120) == 0, first.log()[-2000:]

    other = start_node(tmp_path, "n", FAST_ARGS + ["--max-steps", "16", "--algorithm", "noloco"])
    assert other.process.wait(timeout=120) == 2, other.log()[-2000:]
    log = other.log()
    assert "--algorithm diloco (this node: noloco)" in log and "--fresh" in log and "--checkpoint-dir" in log
    assert "Traceback" not in log
    assert [p.name for p in (tmp_path / "n").glob("checkpoint*.pt")] == ["checkpoint.pt"], "nothing was overwritten"

    fresh = start_node(tmp_path, "n", FAST_ARGS + ["--max-steps", "16", "--algorithm", "noloco", "--fresh"])
    assert fresh.process.wait(timeout=120) == 0, fresh.log()[-2000:]
    info = fresh.info()
    assert info["resumed_from"] is None and not [e for e in info["events"] if e["event"] == "resumed"]
    assert len(list((tmp_path / "n").glob("checkpoint.replaced-*.pt"))) == 1, "the old checkpoint was moved aside"
    assert checkpoint.load(tmp_path / "n" / "checkpoint.pt")["settings"]["algorithm"] == "noloco"


def test_swarm_says_which_nodes_resume_and_refuses_other_settings(tmp_path, capsys):
    from node.config import NodeConfig
    from node.ops.launcher import SwarmLauncher
    from node.runtime.settings import run_settings

    saved = run_settings(NodeConfig(model="nano"))
    checkpoint.save_atomic({"round": 7, "settings": saved}, tmp_path / "node0" / "checkpoint.pt")

    def launcher(**cfg) -> SwarmLauncher:
        return SwarmLauncher(nodes=2, duration=1, report=tmp_path / "r.json", metrics_port=0, run_dir=tmp_path, join_args=[],
                             config=NodeConfig(model="nano", **cfg))

    assert launcher().check_checkpoints() is None
    said = capsys.readouterr().out
    assert "node 0 resumes" in said and "(round 7)" in said and "node 1" not in said
    problem = launcher(algorithm="sparseloco").check_checkpoints()
    assert problem and "--algorithm diloco (this node: sparseloco)" in problem and "--compression none" in problem
    assert "--fresh" in problem
    assert launcher(algorithm="sparseloco", fresh=True).check_checkpoints() is None


def test_join_hint_leads_with_addresses_others_can_dial():
    from node.runtime.reachability import dialable_addresses

    peer = "/p2p/12D3KooWFjXsHsvh1LqZB1dDQNnci4wQmNDza2R5FJN2QEivr5go"
    loopback, lan, public = f"/ip4/127.0.0.1/tcp/1{peer}", f"/ip4/192.168.1.20/tcp/1{peer}", f"/ip4/8.8.4.4/tcp/1{peer}"
    relay = f"/ip4/8.8.8.8/tcp/2/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo/p2p-circuit{peer}"
    assert dialable_addresses([loopback, lan, public]) == [public, lan]
    assert dialable_addresses([loopback, lan, relay]) == [relay, lan]
    assert dialable_addresses([loopback]) == [loopback], "loopback only when it is all there is"


def test_swarm_progress_is_a_table_of_one_row_per_node(tmp_path):
    from rich.console import Console

    from node.ops.launcher import NodeProcess
    from node.ops.progress import progress_lines, progress_rows, progress_table

    nodes = [NodeProcess(i, tmp_path / f"node{i}", 1) for i in range(3)]  # port 1: nothing answers yet
    (tmp_path / "node1").mkdir()
    (tmp_path / "node1" / "info.json").write_text('{"role": "stage", "stage": 2}')
    rows = progress_rows(nodes)
    assert [r["step"] for r in rows] == ["starting"] * 3 and rows[1]["role"] == "stage 2"
    console = Console(width=80, record=True, file=open(tmp_path / "screen.txt", "w"))
    console.print(progress_table(rows, "swarm of 3 nodes"))
    screen = console.export_text()
    assert all(len(line) <= 80 for line in screen.splitlines())
    assert sum(1 for line in screen.splitlines() if "starting" in line) == 3
    assert all(len(line) <= 120 for line in progress_lines(rows, 12.0))


def test_a_resumed_node_keeps_its_error_feedback(tmp_path):
    """A lossy codec's residuals (the mass earlier rounds did not send yet) are part of the checkpoint: a
    node stopped before its next round saves exactly the residuals it resumed with."""
    from tests.helpers.swarm_utils import FAST_ARGS, start_node

    args = [*FAST_ARGS, "--algorithm", "sparseloco"]
    first = start_node(tmp_path, "n", [*args, "--max-steps", "31"])
    assert first.process.wait(timeout=120) == 0, first.log()[-2000:]
    saved = checkpoint.load(first.info()["checkpoint"])["error_feedback"]
    residuals = [t for fragment in saved for t in fragment if t is not None]
    assert residuals and sum(float(t.norm()) for t in residuals) > 0, "two sparse rounds leave a residual"

    again = start_node(tmp_path, "n", [*args, "--max-steps", "3"])  # stops within its first round
    assert again.process.wait(timeout=120) == 0, again.log()[-2000:]
    assert "error feedback starts empty" not in again.log()
    assert again.info()["outer_rounds"] == 0
    kept = checkpoint.load(again.info()["checkpoint"])["error_feedback"]
    assert [[None if t is None else t.tolist() for t in fragment] for fragment in kept] == \
        [[None if t is None else t.tolist() for t in fragment] for fragment in saved]
