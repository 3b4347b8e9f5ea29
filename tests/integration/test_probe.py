"""The light client: ``node probe`` over py-libp2p against a real daemon of a private swarm, its errors,
and ``node status --watch``. Anything that imports py-libp2p runs in a subprocess (it cannot share a
process with hivemind, which other test modules import)."""

import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys

import pytest

from node.ops.launcher import free_port
from tests.helpers.swarm_utils import FAST_ARGS, kill_group, start_node

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("libp2p") is None,
                                 reason="needs the lite extra: pip install -e '.[dev,lite]' (make setup installs it)"),
              pytest.mark.xdist_group("probe")]  # one worker runs the module, so its shared daemon starts once

RUN = "probe-test"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("LOCOMESH_")}


@pytest.fixture(scope="module")
def keyed_node(tmp_path_factory):
    """One daemon of a private swarm, shared by this module's tests: (handle, multiaddr, key file)."""
    directory = tmp_path_factory.mktemp("probe")
    key = directory / "swarm.key"
    key.write_text(secrets.token_hex(32))
    # it trains alone for the module's ~2 minutes, which only its status shows: sleeping 9/10 of each step
    # (--slowdown) leaves the suite's two cores to the other tests
    handle = start_node(directory, "node0", FAST_ARGS + ["--run-id", RUN, "--swarm-key", str(key), "--slowdown", "10"])
    try:
        yield handle, handle.multiaddr(), key
    finally:
        kill_group(handle)


def node(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node", *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def test_the_light_client_stream_speaks_the_shared_framing():
    out = subprocess.run([sys.executable, "-m", "tests.helpers.lite_checks", "stream"], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stream checks passed" in out.stdout


def test_probe_reports_the_node_status_without_hivemind_or_torch(keyed_node):
    handle, maddr, key = keyed_node
    before = handle.wait(lambda i: i.get("outer_rounds", 0) >= 1, 120, "a first round")
    out = subprocess.run([sys.executable, "-m", "tests.helpers.lite_checks", "cli", "probe", maddr, "--json", "--swarm-key-file", str(key)],
                         capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stderr.split("LOADED ", 1)[1].splitlines()[0])
    assert "torch" not in loaded and "hivemind" not in loaded, loaded
    assert "libp2p" in loaded, loaded
    status = json.loads(out.stdout)
    info = handle.info()
    assert status["peer_id"] == info["peer_id"] == maddr.rsplit("/p2p/", 1)[1]
    assert status["run_id"] == RUN
    assert status["state"] == "training"
    for counter in ("round", "inner_step", "steps"):
        assert isinstance(status[counter], int), (counter, status)
    # a lone node trains H = 15 steps a round from step 0: steps = 15·round + inner_step (15 more if the
    # status was read between a round's start and its end; ±1 if read across a step: the counters are
    # read one after the other while training goes on), and the probe is no older than the info file
    h = 15
    assert 0 <= status["inner_step"] < h and status["round"] >= before["outer_rounds"] and status["steps"] >= before["steps"], (status, before)
    assert status["steps"] - h * status["round"] - status["inner_step"] in (-1, 0, 1, h - 1, h, h + 1), status
    assert status["model"] == "nano" and status["algorithm"] == "diloco"
    assert "/locomesh/status/1.0" in status["protocols"]
    assert status["probe"]["address"] == maddr and 0 < status["probe"]["connect_s"] < 10

    # the default output is a table of the same status
    table = node("probe", maddr, "--swarm-key-file", str(key))
    assert table.returncode == 0, table.stderr
    assert status["peer_id"] in table.stdout and RUN in table.stdout and "outer round" in table.stdout


def test_probe_failures_are_one_line_with_what_to_do(keyed_node, tmp_path):
    _, maddr, key = keyed_node
    peer = maddr.rsplit("/p2p/", 1)[1]
    other_key = tmp_path / "other.key"
    other_key.write_text(secrets.token_hex(32))
    silent = socket.socket()  # accepts TCP connections and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    stranger = "12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp"
    cases = {
        "no key": (["probe", maddr], "private swarm", "--swarm-key-file"),
        "wrong key": (["probe", maddr, "--swarm-key-file", str(other_key)], "refused the key", "not this swarm's key"),
        "wrong peer": (["probe", maddr.replace(peer, stranger)], f"is {peer}, not {stranger}", "multiaddr it prints"),
        "closed port": (["probe", f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{peer}"], "cannot reach", "is the node running"),
        "silent port": (["probe", f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{peer}", "--timeout", "2"],
                        "no answer", "--timeout"),
        "bad address": (["probe", "/ip4/127.0.0.1/tcp/4001"], "not a node multiaddr", "/p2p/"),
    }
    try:  # one process runs every case: the imports are paid once
        out = subprocess.run([sys.executable, "-m", "tests.helpers.lite_checks", "batch", json.dumps([args for args, *_ in cases.values()])],
                             capture_output=True, text=True, timeout=120, env=ENV)
    finally:
        silent.close()
    assert out.returncode == 0, out.stderr
    results = dict(zip(cases, json.loads(out.stdout)))
    for name, result in results.items():
        _, what, hint = cases[name]
        assert result["code"] != 0, (name, result)
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (name, result["stderr"])
        assert what in lines[0] and hint in lines[0], (name, lines[0])
    assert results["bad address"]["code"] == 2


def test_the_wrong_key_refusal_arrives_every_time(keyed_node, tmp_path):
    """The node refuses a wrong key and then closes: the refusal must reach the client every time, not
    be lost when the node's side goes away (that race once made every few probes say "stream closed")."""
    _, maddr, _ = keyed_node
    other_key = tmp_path / "other.key"
    other_key.write_text(secrets.token_hex(32))
    tries = 25
    out = subprocess.run([sys.executable, "-m", "tests.helpers.lite_checks", "batch",
                          json.dumps([["probe", maddr, "--swarm-key-file", str(other_key)]] * tries)],
                         capture_output=True, text=True, timeout=240, env=ENV)
    assert out.returncode == 0, out.stderr
    messages = [result["stderr"].strip() for result in json.loads(out.stdout)]
    wrong = [m for m in messages if "refused the key" not in m or "not this swarm's key" not in m]
    assert not wrong, f"{len(wrong)} of {tries} probes were told something else: {sorted(set(wrong))}"


def test_status_watch_prints_one_json_line_per_refresh(keyed_node):
    handle, maddr, key = keyed_node
    out = node("status", "--initial-peers", maddr, "--run-id", RUN, "--swarm-key", str(key), "--watch", "--count", "2",
               "--interval", "1", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout
    peer = handle.info()["peer_id"]
    for line in lines:
        result = json.loads(line)
        assert result["run_id"] == RUN
        assert [p["peer_id"] for p in result["peers"]] == [peer]
        assert result["peers"][0]["reachable"] and result["peers"][0]["live"]["peer_id"] == peer
    assert json.loads(lines[1])["time"] > json.loads(lines[0])["time"]


def test_status_watch_table_stops_after_count(keyed_node):
    _, maddr, key = keyed_node
    out = node("status", "--initial-peers", maddr, "--run-id", RUN, "--swarm-key", str(key), "--watch", "--count", "1", timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"run {RUN}: 1 peers" in out.stdout and "Ctrl-C to stop" in out.stdout


def test_status_against_a_peer_of_another_run_names_that_run(keyed_node):
    _, maddr, key = keyed_node
    out = node("status", "--initial-peers", maddr, "--swarm-key", str(key), timeout=120)  # default run: locomesh-demo
    assert out.returncode == 0, out.stderr
    assert f"is in run {RUN}: add --run-id {RUN}" in out.stdout, out.stdout
