"""Helpers to run real `node join` daemons on loopback in tests and to check nothing outlives them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from node.ops.launcher import free_port
from tests.helpers.zygote import ForkedProcess, launch

FAST_ARGS = ["--model", "nano", "--batch-size", "8", "--inner-steps", "15", "--threads", "1", "--warmup-steps", "10",
             "--eval-batches", "4", "--averaging-timeout", "20"]


@dataclass
class NodeHandle:
    name: str
    directory: Path
    process: subprocess.Popen | ForkedProcess
    metrics_port: int

    @property
    def info_file(self) -> Path:
        return self.directory / "info.json"

    def info(self) -> dict[str, Any]:
        try:
            return json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            return {}

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.info()
            if info and predicate(info):
                return info
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.process.returncode} while waiting for {what}:\n{self.log()[-3000:]}")
            time.sleep(0.3)
        raise AssertionError(f"{self.name}: no {what} after {timeout}s:\n{self.log()[-3000:]}")

    def multiaddr(self) -> str:
        return self.wait(lambda i: i.get("state") == "training", 90, "startup")["multiaddrs"][0]

    def log(self) -> str:
        try:
            return (self.directory / "log.txt").read_text()
        except OSError:
            return ""

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


def events(node: NodeHandle, kind: str) -> list[dict[str, Any]]:
    """The node's reported events of one kind."""
    return [e for e in node.info().get("events", []) if e["event"] == kind]


def full_rounds(info: dict[str, Any], members: int, after: float | None = None) -> list[dict[str, Any]]:
    """The rounds in a node's info that ``members`` contributors averaged in sync (those reported after
    time ``after`` only, if given)."""
    return [r for r in info.get("rounds", []) if r.get("contributors") == members and r.get("in_sync")
            and (after is None or r["t"] > after)]


def agreed_rounds(infos: list[dict[str, Any]], first: int) -> dict[int, list[dict[str, Any]]]:
    """The in-sync records of every round from ``first`` on, by round, after checking that the nodes recording a
    round agree on its contributors and hold the same φ after it."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for info in infos:
        for r in info["rounds"]:
            if r["in_sync"] and r["round"] >= first:
                by_round.setdefault(r["round"], []).append(r)
    for number, records in by_round.items():
        assert len({tuple(r["members"]) for r in records}) == 1, f"round {number}: members disagree on the contributors: {records}"
        assert len({r["fingerprint"] for r in records}) == 1, f"round {number}: replicas differ after it: {records}"
    return by_round


def start_node(directory: Path, name: str, args: list[str], initial_peers: list[str] | None = None,
               env: dict[str, str] | None = None, listen: str = "/ip4/127.0.0.1/tcp/0") -> NodeHandle:
    """``node join ARGS`` in its own folder and process group; ``env`` adds environment variables (the
    user's ``LOCOMESH_*`` ones are dropped), e.g. ``LOCOMESH_FAKE_PROTOCOL_VERSION`` to play another version."""
    directory = Path(directory) / name
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "info.json").unlink(missing_ok=True)  # a restart must not read the last run's info
    port = free_port()
    cmd = ["join", *args, "--listen", listen, "--metrics-port", str(port),
           "--checkpoint-dir", str(directory), "--info-file", str(directory / "info.json")]
    for peer in initial_peers or []:
        cmd += ["--initial-peers", peer]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LOCOMESH_")} | (env or {})
    return NodeHandle(name, directory, launch("node", cmd, environ, directory / "log.txt"), port)


def descendants(pid: int) -> set[int]:
    """All live descendants of ``pid`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_group(handle: NodeHandle) -> None:
    """Test cleanup: make sure nothing of this node survives a failed test."""
    try:
        os.killpg(handle.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        handle.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def start_attacker(tmp_path: Path, boot: str, *args: str) -> tuple[NodeHandle, Path]:
    """``tests.helpers.attacker`` joined to ``boot`` in its own folder; returns its handle and report file."""
    folder = tmp_path / "attacker"
    folder.mkdir()
    report = folder / "report.json"
    process = launch("tests.helpers.attacker", ["--initial-peers", boot, "--report", str(report), *args], dict(os.environ),
                     folder / "log.txt")
    return NodeHandle("attacker", folder, process, 0), report


def attacker_report(handle: NodeHandle, report: Path, ready: Callable[[dict], bool], timeout: float = 60) -> dict:
    """The attacker's report once ``ready`` says it has done enough (fails if it exits or stores nothing)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            found = json.loads(report.read_text())
            if ready(found):
                return found
        except (OSError, ValueError, KeyError):
            pass
        assert handle.process.poll() is None, f"the attacker exited:\n{handle.log()[-3000:]}"
        time.sleep(0.3)
    raise AssertionError(f"the attacker stored nothing in {timeout}s:\n{handle.log()[-3000:]}")
