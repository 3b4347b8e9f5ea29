"""Gather what a CUDA machine with its own torch and Python lacks to run this project, into ``.gpu/``.

    python -m benchmarks.gpu_bundle [--python-version 3.12] [--have FILE] [--out .gpu]

A borrowed GPU machine usually comes with a CUDA build of torch and a scientific stack, but not hivemind (with its
p2pd), pydantic or the project's smaller dependencies, and often cannot reach a package index. This collects,
from this project's virtual environment, every installed distribution that the machine does not have
(``--have``: a file of distribution names, one per line or whitespace separated):

- pure-Python ones are copied file by file into ``.gpu/site`` (hivemind's p2pd binary included);
- compiled ones are downloaded as wheels for ``--python-version`` on manylinux x86-64 into ``.gpu/whl``
  (the same versions as here).

``benchmarks/gpu_check.sh`` installs ``.gpu/whl`` and puts ``.gpu/site`` on ``PYTHONPATH``. The folder is
ignored by git; carry it to the machine beside the working tree.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Installed here for development only (type stubs, this project itself): never needed on the GPU machine.
SKIP = {"locomesh", "mypy-protobuf", "grpcio-tools", "pip", "setuptools", "wheel"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed(have: set[str], root: str = "locomesh", extras: tuple[str, ...] = ("dev",)) -> set[str]:
    """Normalised names of the installed distributions ``root`` (with ``extras``) needs, directly or not; what
    ``have`` names is not followed (the machine has it with its own requirements)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        if normalise(name) in seen:
            continue
        seen.add(normalise(name))
        if normalise(name) in have:
            continue
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            env = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in env):
                todo.append((req.name, tuple(req.extras)))
    return seen


def is_compiled(dist: md.Distribution) -> bool:
    return any(str(f).endswith((".so", ".pyd")) for f in dist.files or ())


def copy_pure(dist: md.Distribution, site: Path) -> int:
    copied = 0
    for f in dist.files or ():
        source = Path(str(dist.locate_file(f)))
        if ".." in f.parts or "__pycache__" in f.parts or not source.is_file():
            continue
        target = site / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        copied += 1
    return copied


def download_wheel(name: str, version: str, folder: Path, python_version: str) -> bool:
    """Whether a binary wheel of exactly this version was found (some old ones have none for a newer Python)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation", "cp",
           "--python-version", python_version, "-d", str(folder), f"{name}=={version}"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--have", type=Path, required=True, help="distribution names the GPU machine already has")
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--out", type=Path, default=Path(".gpu"))
    args = parser.parse_args(argv)
    have = {normalise(n) for n in args.have.read_text().split()}
    wanted = needed(have)
    site, wheels = args.out / "site", args.out / "whl"
    shutil.rmtree(args.out, ignore_errors=True)
    site.mkdir(parents=True)
    wheels.mkdir()
    for dist in sorted(md.distributions(), key=lambda d: normalise(d.metadata["Name"])):
        name = normalise(dist.metadata["Name"])
        if name not in wanted or name in have or name in SKIP or name.startswith(("types-", "nvidia-")):
            continue
        if is_compiled(dist):
            found = download_wheel(dist.metadata["Name"], dist.version, wheels, args.python_version)
            print(f"wheel {name} {dist.version}" if found else f"MISSING {name} {dist.version}: no binary wheel for "
                  f"Python {args.python_version}; what imports it will fail there")
        else:
            print(f"copy  {name} {dist.version}: {copy_pure(dist, site)} files")
    p2pd = site / "hivemind" / "hivemind_cli" / "p2pd"
    if p2pd.exists():
        p2pd.chmod(0o755)


if __name__ == "__main__":
    main()
