"""Churn soak (slow; `make test-slow` or `pytest -m slow tests/integration/test_soak.py`).

A swarm of 5 daemons on loopback; every 30–60 s a random node is killed with SIGKILL (alternately
the Python process alone, as in a crash, and its whole process group, as in a machine dying) and
restarted 5 s later from its checkpoint directory with every other node as an initial peer.
Asserts: the swarm keeps training (held-out loss far below the start, and still falling in the
second half), no round waited longer than its deadline, every restarted node resumed or re-synced,
and no process outlives the swarm. Writes a JSON report (``LOCOMESH_SOAK_REPORT``, default
``runs/soak/report.json``). ``LOCOMESH_SOAK_MINUTES`` sets the length (default 15).
"""

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.swarm_utils import alive, descendants, free_port, kill_group, start_node

pytestmark = pytest.mark.slow

TIMEOUT = 20.0
ARGS = ["--model", "tiny", "--batch-size", "8", "--inner-steps", "20", "--threads", "1", "--warmup-steps", "20",
        "--eval-batches", "8", "--averaging-timeout", str(TIMEOUT), "--join-timeout", "20"]


def test_churn_soak(tmp_path):
    minutes = float(os.environ.get("LOCOMESH_SOAK_MINUTES", "15"))
    report_path = Path(os.environ.get("LOCOMESH_SOAK_REPORT", "runs/soak/report.json"))
    rng = random.Random(7)
    n = 5
    ports = [free_port() for _ in range(n)]

    def args_for(i):
        return ARGS + ["--seed", str(i), "--identity", str(tmp_path / f"id{i}.key")]

    handles = {}
    family: set[int] = set()
    t0 = time.time()
    events, curve = [], []
    try:
        for i in range(n):
            listen = f"/ip4/127.0.0.1/tcp/{ports[i]}"
            peers = [] if i == 0 else [handles[0]["addr"]]
            h = start_node(tmp_path, f"n{i}", args_for(i) + ["--listen", listen], peers)
            h.multiaddr()
            handles[i] = {"handle": h, "addr": [a for a in h.info()["multiaddrs"] if str(ports[i]) in a][0]}
        all_addrs = {i: handles[i]["addr"] for i in range(n)}
        end = t0 + minutes * 60
        next_kill = time.time() + rng.uniform(30, 60)
        kills = 0
        while time.time() < end:
            for i, entry in handles.items():
                family |= descendants(entry["handle"].process.pid)
            infos = {i: e["handle"].info() for i, e in handles.items()}
            live = [x for x in infos.values() if x.get("state") == "training"]
            if live:
                curve.append({"t": round(time.time() - t0, 1), "loss": min(x["train_loss_last"] for x in live),
                              "round": max(x["outer_rounds"] + (x.get("joined_round") or 0) for x in live)})
            if time.time() >= next_kill:
                victim = rng.randrange(n)
                h = handles[victim]["handle"]
                if kills % 2 == 0:
                    os.kill(h.process.pid, signal.SIGKILL)
                    how = "process"
                else:
                    os.killpg(h.process.pid, signal.SIGKILL)
                    how = "group"
                h.process.wait()
                events.append({"t": round(time.time() - t0, 1), "event": "kill", "node": victim, "how": how})
                kills += 1
                time.sleep(5)
                peers = [a for j, a in all_addrs.items() if j != victim]
                h2 = start_node(tmp_path, f"n{victim}", args_for(victim) + ["--listen", f"/ip4/127.0.0.1/tcp/{ports[victim]}"], peers)
                handles[victim]["handle"] = h2
                events.append({"t": round(time.time() - t0, 1), "event": "restart", "node": victim})
                next_kill = time.time() + rng.uniform(30, 60)
            time.sleep(5)
        for entry in handles.values():
            family |= descendants(entry["handle"].process.pid)
        codes = {i: e["handle"].stop(timeout=120) for i, e in handles.items()}
    finally:
        for entry in handles.values():
            kill_group(entry["handle"])
    time.sleep(2)

    finals = {i: e["handle"].info() for i, e in handles.items()}
    logs = {i: (tmp_path / f"n{i}" / "log.txt").read_text() for i in range(n)}
    rounds = [r for info in finals.values() for r in info.get("rounds", [])]
    max_gather = max((r["gather_s"] for r in rounds), default=0.0)
    max_round = max((r["duration_s"] for r in rounds), default=0.0)
    restarts = [e for e in events if e["event"] == "restart"]
    recovered = {e["node"] for e in events if e["event"] == "restart"}
    leftovers = [p for p in family if alive(p)]
    report = {
        "minutes": minutes, "nodes": n, "kills": len([e for e in events if e["event"] == "kill"]),
        "restarts": len(restarts), "exit_codes": codes, "max_gather_s": max_gather, "max_round_s": max_round,
        "deadline_s": TIMEOUT, "final_val_loss": {i: f.get("val_loss") for i, f in finals.items()},
        "leftover_processes": leftovers, "events": events, "loss_curve": curve,
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2))

    assert report["kills"] >= max(1, int(minutes * 60 / 60) - 1)
    assert all(c == 0 for c in codes.values()), codes
    assert not leftovers, f"processes outlived the swarm: {leftovers}"
    assert max_gather <= TIMEOUT + 5, f"a round waited {max_gather:.1f}s at the rendezvous (deadline {TIMEOUT}s)"
    assert max_round <= 2 * TIMEOUT + 15, f"a round took {max_round:.1f}s"
    for i in recovered:  # the last incarnation of every restarted node resumed or re-synced
        kinds = {e["event"] for e in finals[i]["events"]}
        assert kinds & {"joined", "resumed"}, (i, kinds, logs[i][-2000:])
    vals = [v for v in report["final_val_loss"].values() if v is not None]
    assert vals and max(vals) < 3.0, report["final_val_loss"]
    half = [c["loss"] for c in curve if c["t"] > minutes * 30]
    assert half and min(half[len(half) // 2 :]) < max(half[: len(half) // 2]), "loss stopped falling in the second half"
