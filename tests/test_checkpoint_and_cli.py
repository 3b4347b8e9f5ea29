"""Checkpoints are atomic; `node swarm` writes the documented report; CLI errors are clear."""

import json
import subprocess
import sys

import pytest
import torch

from node import checkpoint


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
    out = subprocess.run([sys.executable, "-m", "node", "eval", "--checkpoint", str(tmp_path / "nope.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no checkpoint at" in out.stderr


def test_swarm_command_writes_the_report(tmp_path):
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "node", "swarm", "--nodes", "2", "--duration", "25", "--report", str(report),
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
        assert node["exit_code"] == 0 and node["outer_rounds"] >= 1 and node["steps"] > 0
        assert set(node["protocols"]) == {"/locomesh/average/1.0", "/locomesh/state/1.0", "/locomesh/status/1.0"}
        assert node["multiaddrs"] and node["multiaddrs"][0].startswith("/ip4/127.0.0.1/tcp/")
    kinds = {e["event"] for e in data["events"]}
    assert {"node_started", "bootstrap_ready", "sigterm", "node_exited", "joined"} <= kinds
    assert "swarm of 2 nodes" in out.stdout


def test_swarm_rejects_bad_join_options(tmp_path):
    out = subprocess.run([sys.executable, "-m", "node", "swarm", "--nodes", "2", "--model", "huge"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown model preset 'huge'" in out.stderr


def test_restarted_node_resumes_from_its_checkpoint(tmp_path):
    from tests.swarm_utils import FAST_ARGS, start_node

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
