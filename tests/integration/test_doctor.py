"""`node doctor` passes on a working machine and fails usefully when something is wrong."""

import json
import socket

from tests.helpers.swarm_utils import FAST_ARGS, kill_group, start_node
from tests.helpers import zygote


def _doctor(*args):
    out = zygote.run(["doctor", "--json", *args], timeout=120)
    return out.returncode, {c["name"]: c for c in json.loads(out.stdout)}


def test_doctor_passes_here_and_names_the_fix_for_a_taken_port(tmp_path):
    code, checks = _doctor("--checkpoint-dir", str(tmp_path))
    assert code == 0, checks
    assert {"python", "torch", "hivemind", "numpy", "p2pd", "listen port", "device", "memory", "disk"} <= set(checks)
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code, checks = _doctor("--listen-port", str(port))
    assert code == 1
    assert not checks["listen port"]["ok"] and "in use" in checks["listen port"]["detail"]
    assert "--listen /ip4/0.0.0.0/tcp/" in checks["listen port"]["fix"]
    assert all(c["ok"] for name, c in checks.items() if name != "listen port")


def test_doctor_checks_peers_and_clock_skew(tmp_path):
    node = start_node(tmp_path, "n", FAST_ARGS)
    try:
        code, checks = _doctor("--initial-peers", node.multiaddr())
        assert code == 0, checks
        assert checks["clock skew"]["ok"] and "1 peers answered" in checks["clock skew"]["detail"]
        code, checks = _doctor("--initial-peers", node.multiaddr(), "--run-id", "no-such-run")
        assert code == 1 and not checks["peers"]["ok"] and "--run-id" in checks["peers"]["fix"]
    finally:
        kill_group(node)
