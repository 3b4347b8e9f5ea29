"""The wheel a volunteer installs: built from the files git tracks, installed into a fresh venv, its
``node`` command runs a 2-node swarm on the corpus the wheel carries and the p2pd hivemind ships.

The fresh venv takes its dependencies from this test's environment through a ``.pth`` line (no index, no
multi-GB download); the editable install of this checkout stays out of it (a ``.pth`` inside a path
added that way is not read), and every command runs outside the checkout, so ``node`` can only come
from the wheel. ``benchmarks/results/wheel_install.json`` records the same wheel in fully clean venvs
(dependencies from the index) on Python 3.11–3.13.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from benchmarks.wheel_install import ROOT, build_wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "locomesh_test_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                          "--no-index", "--ignore-installed", str(wheel)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return venv


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def test_the_wheel_installs_into_a_fresh_venv_and_its_node_command_runs_a_swarm(tmp_path: Path) -> None:
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout: the wheel is built from the files git tracks")
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("node/data/corpus/") for n in names), "the embedded corpus travels in the wheel"
    assert any(n.endswith("entry_points.txt") for n in names)
    packages = {n.split("/")[0] for n in names if not n.startswith("locomesh-")}
    assert packages == {"node", "protocol", "compression", "gossip", "swarm"}, packages

    venv = fresh_venv(tmp_path, wheel)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import json, node, hivemind, os; from hivemind.p2p.p2p_daemon import P2P;"
         "from node.data.byte_corpus import load_embedded_corpus; c = load_embedded_corpus();"
         "p2pd = os.path.join(os.path.dirname(hivemind.__file__), 'hivemind_cli', 'p2pd');"
         "print(json.dumps({'node': node.__file__, 'corpus': c.source, 'bytes': len(c.train), 'p2pd': os.access(p2pd, os.X_OK)}))"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=clean_env())
    assert where.returncode == 0, where.stderr[-3000:]
    found = json.loads(where.stdout)
    assert Path(found["node"]).is_relative_to(venv), f"node imported from {found['node']}, not the wheel"
    assert found["bytes"] > 100_000 and found["p2pd"], found

    report = tmp_path / "report.json"
    out = subprocess.run(
        [str(venv / "bin" / "node"), "swarm", "--nodes", "2", "--duration", "20", "--report", str(report),
         "--model", "nano", "--inner-steps", "10", "--batch-size", "8", "--eval-batches", "2",
         "--checkpoint-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=clean_env())
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    nodes = json.loads(report.read_text())["nodes"]
    assert len(nodes) == 2
    for node in nodes:
        assert node["exit_code"] == 0 and node["steps"] > 0 and node["outer_rounds"] >= 1, node
