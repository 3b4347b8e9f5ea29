"""``node service install | remove``: the systemd user unit around ``node join`` (checked by systemd-analyze when present)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from node.cli.app import main


def node(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    out = capsys.readouterr()
    return int(done.value.code or 0), out.out, out.err


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    for var in ("LOCOMESH_RUN_ID", "LOCOMESH_MODEL", "LOCOMESH_CHECKPOINT_DIR"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_install_writes_a_unit_that_runs_this_venvs_node_join(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = node("service", "install", "--run-id", "r1", "--model", "nano", "--active-hours", "22-7",
                          "--data", "my corpus%.txt", capsys=capsys)
    assert code == 2 and "--data my corpus%.txt: no such file" in err  # checked as node join checks it
    (home / "my corpus%.txt").write_text("some text " * 100)
    code, out, err = node("service", "install", "--run-id", "r1", "--model", "nano", "--active-hours", "22-7",
                          "--data", "my corpus%.txt", capsys=capsys)
    assert code == 0, err
    unit = home / "config" / "systemd" / "user" / "locomesh-r1.service"
    text = unit.read_text()
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    program = exec_start.removeprefix("ExecStart=").split()[0]
    assert Path(program).is_absolute() and Path(program).parent == Path(sys.executable).parent
    assert " join --run-id r1 --model nano --active-hours 22-7 " in exec_start
    assert '--data "my corpus%%.txt"' in exec_start  # quoted, % escaped for systemd
    assert f"--checkpoint-dir {home / 'data' / 'locomesh' / 'r1'}" in exec_start  # restarts resume
    for line in ("Restart=on-failure", "KillSignal=SIGTERM", "KillMode=mixed", "StandardOutput=journal",
                 f"WorkingDirectory={home}", "WantedBy=default.target"):
        assert line in text.splitlines(), line
    stop = int(next(line for line in text.splitlines() if line.startswith("TimeoutStopSec=")).split("=")[1])
    assert stop >= 120  # the clean leave: last heartbeat, final evaluation and checkpoint, p2pd's shutdown
    assert "systemctl --user daemon-reload && systemctl --user enable --now locomesh-r1.service" in out
    assert "loginctl enable-linger $USER" in out
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here: the unit's syntax was not verified")
    check = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert check.returncode == 0 and not check.stderr.strip(), check.stderr


def test_install_refuses_bad_options_and_an_existing_unit(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = home / "units"
    code, _, err = node("service", "install", "--unit-dir", str(folder), "--model", "huge", capsys=capsys)
    assert code == 2 and "unknown model preset 'huge'" in err and not folder.exists()
    code, _, err = node("service", "install", "--unit-dir", str(folder), "--active-hours", "22-25", capsys=capsys)
    assert code == 2 and "active" in err and not folder.exists()
    assert node("service", "install", "--unit-dir", str(folder), "--name", "night", capsys=capsys)[0] == 0
    code, _, err = node("service", "install", "--unit-dir", str(folder), "--name", "night", capsys=capsys)
    assert code == 2 and "exists" in err and "--force" in err
    assert node("service", "install", "--unit-dir", str(folder), "--name", "night", "--force", "--model", "micro",
                capsys=capsys)[0] == 0
    assert "--model micro" in (folder / "night.service").read_text()


def test_remove_deletes_the_unit_and_its_enablement(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = home / "units"
    assert node("service", "install", "--unit-dir", str(folder), "--run-id", "r2", capsys=capsys)[0] == 0
    wants = folder / "default.target.wants"
    wants.mkdir()
    (wants / "locomesh-r2.service").symlink_to(folder / "locomesh-r2.service")  # what `systemctl --user enable` makes
    code, out, _ = node("service", "remove", "--unit-dir", str(folder), "--run-id", "r2", capsys=capsys)
    assert code == 0 and "systemctl --user stop locomesh-r2.service" in out
    assert not (folder / "locomesh-r2.service").exists() and not (wants / "locomesh-r2.service").is_symlink()
    code, _, err = node("service", "remove", "--unit-dir", str(folder), "--run-id", "r2", capsys=capsys)
    assert code == 2 and "no unit" in err
