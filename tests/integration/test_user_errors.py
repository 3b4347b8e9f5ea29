"""Every mistake a user makes gets one clear line: bad flags, files, ports and devices in every command;
one daemon per checkpoint folder; help whole at 80 columns; per-node seeds of ``node swarm --seed``."""

import json
import os
import socket
import subprocess
import sys

from node.config import NodeConfig
from tests.helpers import zygote

ENV = {k: v for k, v in os.environ.items() if not k.startswith("LOCOMESH_")}
PEER = "12D3KooWFjXsHsvh1LqZB1dDQNnci4wQmNDza2R5FJN2QEivr5go"
MADDR = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"


def batch(cases: list[list[str]], env: dict | None = None, timeout: float = 240) -> list[dict]:
    # exec'd, not forked: the probe commands load py-libp2p, which cannot share a process with hivemind
    out = subprocess.run([sys.executable, "-m", "tests.helpers.cli_batch", json.dumps(cases)], capture_output=True, text=True,
                         timeout=timeout, env=env or ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def check_one_line(name: str, result: dict, *named: str, code: int = 2) -> None:
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["code"] == code, (name, result)
    assert "Traceback" not in result["stderr"] + result["stdout"], (name, result["stderr"])
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, result["stderr"])
    for what in named:
        assert what in lines[0], (name, what, lines[0])


def test_bad_input_in_every_command_is_one_line_with_exit_2(tmp_path):
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    empty, a_file, junk = tmp_path / "empty.txt", tmp_path / "a-file", tmp_path / "junk.pt"
    empty.write_text("")
    a_file.write_text("x")
    junk.write_bytes(b"PK\x03\x04 not a checkpoint at all" * 10)
    missing = str(tmp_path / "missing")
    cases = {  # name: (argv, what the line must name)
        "join data missing": (["join", "--data", "/nonexistent"], ["--data /nonexistent"]),
        "join data empty": (["join", "--data", str(empty)], ["--data", "empty"]),
        "join checkpoint-dir uncreatable": (["join", "--checkpoint-dir", "/proc/forbidden"], ["--checkpoint-dir /proc/forbidden"]),
        "join checkpoint-dir is a file": (["join", "--checkpoint-dir", str(a_file)], ["--checkpoint-dir", "is a file"]),
        "join device cuda": (["join", "--device", "cuda"], ["--device cuda", "--device auto"]),
        "join device tpu": (["join", "--device", "tpu"], ["--device"]),
        "join metrics-port taken": (["join", "--metrics-port", str(port)], [f"--metrics-port {port}", "in use"]),
        "join lr nan": (["join", "--lr", "nan"], ["--lr", "finite"]),
        "join codec": (["join", "--compression", "q3"], ["q3", "Valid forms"]),
        "join model": (["join", "--model", "huge"], ["huge", "nano"]),
        "join peers": (["join", "--initial-peers", "garbage"], ["garbage", "multiaddr"]),
        "join config missing": (["join", "--config", missing], [missing]),
        "join swarm-key missing": (["join", "--swarm-key", missing], ["--swarm-key", missing]),
        "join batch-size": (["join", "--batch-size", "0"], ["--batch-size"]),
        "join inner-steps": (["join", "--inner-steps", "abc"], ["--inner-steps"]),
        "join log-level": (["join", "--log-level", "loud"], ["--log-level"]),
        "join stage": (["join", "--stages", "2", "--stage", "5"], ["--stage 5"]),
        "join fragments": (["join", "--fragments", "100"], ["--fragments"]),
        "join info-file": (["join", "--info-file", "/proc/forbidden/info.json"], ["--info-file"]),
        "join unknown flag": (["join", "--no-such-flag"], ["--no-such-flag"]),
        "join algorithm": (["join", "--algorithm", "sgd"], ["--algorithm"]),
        "swarm nodes": (["swarm", "--nodes", "0"], ["--nodes"]),
        "swarm duration": (["swarm", "--duration", "-5"], ["--duration"]),
        "swarm chaos": (["swarm", "--chaos", "explode"], ["--chaos"]),
        "swarm node-args": (["swarm", "--nodes", "2", "--node-args", "9:--slowdown 3"], ["--node-args"]),
        "swarm model": (["swarm", "--model", "huge"], ["huge"]),
        "status peers": (["status", "--initial-peers", "garbage"], ["--initial-peers", "garbage"]),
        "status no peers": (["status"], ["--initial-peers"]),
        "status key": (["status", "--initial-peers", MADDR, "--swarm-key", missing], ["--swarm-key", missing]),
        "eval not a checkpoint": (["eval", "--checkpoint", str(junk)], [str(junk), "not a readable locomesh checkpoint"]),
        "eval missing": (["eval", "--checkpoint", missing], [missing]),
        "eval weights": (["eval", "--checkpoint", str(junk), "--weights", "bogus"], ["--weights"]),
        "eval batches": (["eval", "--checkpoint", str(junk), "--batches", "0"], ["--batches"]),
        "eval data": (["eval", "--checkpoint", str(junk), "--data", "/nonexistent"], ["--data /nonexistent"]),
        "doctor port": (["doctor", "--listen-port", "70000"], ["--listen-port"]),
        "doctor device": (["doctor", "--device", "tpu"], ["--device"]),
    }
    probe_cases = {  # py-libp2p cannot share a process with hivemind: its own batch
        "probe address": (["probe", "/ip4/127.0.0.1/tcp/4001"], ["/p2p/"]),
        "probe key": (["probe", MADDR, "--swarm-key-file", missing], ["--swarm-key", missing]),
    }
    try:
        results = batch([argv for argv, _ in cases.values()])
        results += batch([argv for argv, _ in probe_cases.values()])
    finally:
        busy.close()
    everything = {**cases, **probe_cases}
    assert len(everything) >= 25
    for (name, (_, named)), result in zip(everything.items(), results):
        check_one_line(name, result, *named)
    assert not (tmp_path / "missing").exists(), "a failed command leaves nothing behind"


def test_a_traceback_only_with_debug_logging():
    results = batch([["join", "--data", "/nonexistent", "--log-level", "debug"]])
    assert "Traceback" in results[0]["stderr"] and "UserError" in results[0]["stderr"]


def test_help_reads_whole_at_80_columns():
    from node.cli.app import join_flags
    from node.config import FLAG_OF

    commands = ["join", "swarm", "status", "probe", "eval", "doctor", "export", "data", "data tokenizer", "data prepare",
                "service", "service install", "service remove"]
    results = batch([[*cmd.split(), "--help"] for cmd in commands], env={**ENV, "COLUMNS": "80"})
    for cmd, result in zip(commands, results):
        assert result["code"] == 0, (cmd, result["stderr"])
        text = result["stdout"]
        assert "…" not in text, cmd
        assert max(len(line) for line in text.splitlines()) <= 80, cmd
    join_help = " ".join(results[0]["stdout"].split())  # names may wrap between words, never inside one
    for name in join_flags.__annotations__:
        if name in ("config", "return"):
            continue
        flag = FLAG_OF.get(name, name)
        assert f"--{flag.replace('_', '-')}" in join_help, name
        assert f"LOCOMESH_{flag.upper()}" in join_help, name


def test_a_second_daemon_on_one_checkpoint_folder_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path, nodes):
    from tests.helpers.swarm_utils import FAST_ARGS, kill_group, start_node

    first = start_node(tmp_path, "n", FAST_ARGS)
    nodes.append(first)
    info = first.wait(lambda i: i.get("state") == "training", 90, "startup")
    second = zygote.run(["join", *FAST_ARGS, "--checkpoint-dir", str(tmp_path / "n")],
                            timeout=120, env=ENV)
    check_one_line("second daemon", {"code": second.returncode, "stdout": second.stdout, "stderr": second.stderr},
                   f"--checkpoint-dir {tmp_path / 'n'} is in use by pid {first.process.pid} (peer {info['peer_id']})")

    kill_group(first)  # SIGKILL: the lock file still names it
    third = start_node(tmp_path, "n", FAST_ARGS + ["--max-steps", "3"])
    nodes.append(third)
    assert third.process.wait(timeout=120) == 0, third.log()[-2000:]
    assert f"taking over the lock of pid {first.process.pid}" in third.log()


def test_stale_lock_file_is_taken_over_and_released_on_exit(tmp_path, caplog):
    from node.checkpoints.folder_lock import LOCK_NAME, FolderLock

    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "peer_id": "gone"}))
    lock = FolderLock(tmp_path).acquire()
    assert "taking over the lock of pid 999999999 (peer gone)" in caplog.text
    held = subprocess.run([sys.executable, "-c", f"from node.checkpoints.folder_lock import FolderLock; FolderLock({str(tmp_path)!r}).acquire()"],
                          capture_output=True, text=True, timeout=60)
    assert held.returncode != 0 and f"in use by pid {os.getpid()}" in held.stderr
    lock.release()
    again = FolderLock(tmp_path).acquire()  # released: no stale owner to warn about
    again.release()
    assert caplog.text.count("taking over") == 1


def test_swarm_seed_gives_each_node_its_own_data_order_and_one_initialisation(tmp_path, monkeypatch):
    from node.ops import launcher

    spawned: list[list[str]] = []

    class FakePopen:
        def __init__(self, args, **_):
            spawned.append(args)
            self.pid = 1

    monkeypatch.setattr(launcher.subprocess, "Popen", FakePopen)
    swarm = launcher.SwarmLauncher(nodes=3, duration=1, report=tmp_path / "r.json", metrics_port=0, run_dir=tmp_path,
                                   join_args=["--model", "nano", "--seed", "7"], config=NodeConfig(model="nano", seed=7),
                                   node_args={2: ["--seed", "100"]})
    for node in swarm.nodes:
        swarm._spawn(node, [])

    def flag(args: list[str], name: str) -> list[str]:
        return [args[i + 1] for i, a in enumerate(args) if a == name]

    assert [flag(a, "--seed") for a in spawned] == [["7"], ["8"], ["100"]]  # node i: S + i; an explicit one wins
    assert [flag(a, "--init-seed") for a in spawned[:2]] == [["7"], ["7"]]
    assert NodeConfig(seed=8, init_seed=7).model_seed == 7 and NodeConfig(seed=8).model_seed == 8


def test_a_port_left_in_time_wait_by_a_killed_node_is_free_for_its_restart():
    from node.cli.preflight import check_port_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection waits in TIME_WAIT
    server.close()
    client.close()
    check_port_free("--metrics-port", port)  # a scrape's TIME_WAIT must not block the restarted node
