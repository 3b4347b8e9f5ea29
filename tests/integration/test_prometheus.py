"""Metrics for real: a Prometheus server scrapes a 3-node swarm; dashboards only query exported metrics."""

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlencode
from urllib.request import urlopen

import pytest

from node.runtime.metrics import NodeMetrics
from tests.helpers.swarm_utils import FAST_ARGS, free_port, kill_group, start_node

ROOT = Path(__file__).resolve().parents[2]


def exported_sample_names() -> set[str]:
    names = set()
    for family in NodeMetrics().registry.collect():
        names.add(family.name)
        for sample in family.samples:
            names.add(sample.name)
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_count", "_sum")}
    return names


def documented_metrics() -> list[str]:
    """Metric names from the Metrics table of docs/operations.md (first column)."""
    text = (ROOT / "docs" / "operations.md").read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return sorted({m for row in text.splitlines() if row.startswith("| `locomesh_") for m in re.findall(r"`(locomesh_[a-z_]+)", row.split("|")[1])})


def test_docs_document_exactly_the_exported_metrics():
    exported = {f.name for f in NodeMetrics().registry.collect()}
    documented = {m.removesuffix("_total") for m in documented_metrics()}
    assert documented == exported


def test_every_dashboard_query_uses_only_exported_metrics():
    exported = exported_sample_names()
    dashboards = list((ROOT / "docker" / "grafana" / "dashboards").glob("*.json"))
    assert dashboards
    seen = 0
    for path in dashboards:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                names = re.findall(r"\blocomesh_[a-z0-9_]+", target["expr"])
                assert names, f"{path.name}: panel {panel['title']!r} queries no locomesh metric"
                unknown = [n for n in names if n not in exported]
                assert not unknown, f"{path.name}: panel {panel['title']!r} uses unexported {unknown}"
                seen += 1
    assert seen >= 10


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urlencode({"query": promql})
    body = json.loads(urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (make test installs Debian's where apt-get runs as root)")
def test_prometheus_scrapes_every_documented_metric_from_every_node(tmp_path):
    nodes = []
    prom = None
    try:
        a = start_node(tmp_path, "a", FAST_ARGS + ["--eval-every", "1"])
        nodes.append(a)
        boot = a.multiaddr()
        nodes += [start_node(tmp_path, n, FAST_ARGS + ["--eval-every", "1"], [boot]) for n in "bc"]
        for h in nodes:
            h.wait(lambda i: i.get("outer_rounds", 0) >= 1, 180, "a round")
        targets = [f"127.0.0.1:{h.metrics_port}" for h in nodes]
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "1s"},
                                      "scrape_configs": [{"job_name": "locomesh", "static_configs": [{"targets": targets}]}]}))
        port = free_port()
        prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prom.log", "w"))
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                if len(_query(port, "up == 1")) == 3:
                    break
            except OSError:
                pass
            time.sleep(1)
        time.sleep(4)
        histograms = {f.name for f in NodeMetrics().registry.collect() if f.type == "histogram"}
        for name in documented_metrics():
            series = name + "_count" if name in histograms else name
            instances = {r["metric"]["instance"] for r in _query(port, f"count by (instance) ({series})")}
            assert instances == set(targets), f"{name}: samples from {sorted(instances)}"
        first = {r["metric"]["instance"]: float(r["value"][1]) for r in _query(port, "locomesh_inner_steps_total")}
        first_val = {r["metric"]["instance"]: float(r["value"][1]) for r in _query(port, "locomesh_val_loss")}
        rounds = {h.name: h.info()["outer_rounds"] for h in nodes}
        for h in nodes:  # two more averaging rounds while Prometheus watches
            h.wait(lambda i, h=h: i.get("outer_rounds", 0) >= rounds[h.name] + 2, 180, "two more rounds")
        time.sleep(3)
        for counter in ("locomesh_inner_steps_total", "locomesh_tokens_total", "locomesh_bytes_sent_total",
                        "locomesh_outer_rounds_total"):
            grown = _query(port, f"sum by (instance) (increase({counter}[2m])) > 0")
            assert {r["metric"]["instance"] for r in grown} == set(targets), counter
        later = {r["metric"]["instance"]: float(r["value"][1]) for r in _query(port, "locomesh_inner_steps_total")}
        assert all(later[i] > first[i] for i in targets)
        # each node's held-out loss fell over the two (or more) rounds it evaluated since
        later_val = {r["metric"]["instance"]: float(r["value"][1]) for r in _query(port, "locomesh_val_loss")}
        assert set(later_val) == set(targets) and all(later_val[i] < first_val[i] for i in targets), (first_val, later_val)
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(timeout=30)
        for h in nodes:
            kill_group(h)
