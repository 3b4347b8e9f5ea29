"""Benchmark tables in the docs, generated from the results files.

    python -m benchmarks.tables            # rewrite every generated table in docs/
    python -m benchmarks.tables --check    # exit 1 naming each table that differs from its results file

A generated table sits between two markers in a docs page::

    <!-- table: frontier -->
    Source: `benchmarks/results/frontier.json` (commit 4b21bdd, 2026-11-23). ...

    | codec | held-out loss | ... |
    <!-- /table -->

Everything between the markers is rewritten from the file(s) the caption names (:data:`TABLES`);
prose around a table is written by hand and names the file it quotes. ``tests/unit/test_docs_tables.py``
runs :func:`check`, so a table edited by hand, or a results file changed without regenerating, fails.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchmarks import tables_gpu as gpu
from benchmarks import tables_network as net
from benchmarks import tables_training as train
from benchmarks.table_format import ROOT, Results

DOCS = (ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "testing.md")
BLOCK = re.compile(r"<!-- table: (?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)<!-- /table -->", re.DOTALL)

TABLES: dict[str, Callable[[Results], str]] = {
    "targets": net.targets,
    "codecs": train.codecs,
    "codec_speed": train.codec_speed,
    "frontier": train.frontier,
    "q2_reduce_scatter": train.q2_reduce_scatter,
    "sparse_gap": train.sparse_gap,
    "gap_closed": train.gap_closed,
    "thin20_race": net.race_seeds,
    "thin20_ablation": partial(net.race, name=net.ABLATION),
    "thin5_race": partial(net.race, name="thin5_race.json"),
    "thin_nat": net.thin_nat,
    "scale": net.scale,
    "wire": net.wire,
    "scale_simulated": net.scale_simulated,
    "bandwidth_cap": net.bandwidth_cap,
    "churn": net.churn,
    "inner_optimizer": train.inner_optimizer,
    "replica_gap": train.replica_gap,
    "stage_spikes": train.stage_spikes,
    "byzantine_diloco": partial(train.byzantine, name="byzantine_diloco.json"),
    "byzantine_sparseloco": partial(train.byzantine, name="byzantine_sparseloco.json"),
    "mutation": train.mutation,
    "convergence": train.convergence,
    "forging": train.forging,
    "heterogeneous": train.heterogeneous,
    "hostile_member": train.hostile_member,
    "quick_suite": net.quick_suite,
    "gpu_loop": gpu.gpu_loop,
    "gpu_replicas": gpu.gpu_replicas,
    "overlap_cpu": gpu.overlap_cpu,
    "overlap_alpha_cpu": gpu.overlap_alpha_cpu,
    "overlap_step_on_cpu": gpu.overlap_step_on_cpu,
    "overlap_capped_cpu": gpu.overlap_capped_cpu,
    "overlap_capped_equal_time_cpu": gpu.overlap_capped_equal_time_cpu,
    "auto_overlap_capped_cpu": gpu.auto_overlap_capped_cpu,
}


class UnknownTable(ValueError):
    """A marker names a table :data:`TABLES` does not know."""


def render(text: str, results: Results) -> str:
    """``text`` with every generated table rewritten from ``results``."""
    def replace(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise UnknownTable(f"<!-- table: {name} -->: no such table (known: {', '.join(TABLES)})")
        return f"<!-- table: {name} -->\n{TABLES[name](results)}\n<!-- /table -->"
    return BLOCK.sub(replace, text)


def stale_tables(text: str, results: Results) -> list[str]:
    """The names of the tables in ``text`` whose content differs from what their files generate."""
    fresh = {m.group("name"): m.group("body") for m in BLOCK.finditer(render(text, results))}
    return [m.group("name") for m in BLOCK.finditer(text) if m.group("body") != fresh[m.group("name")]]


def check(docs: tuple[Path, ...] = DOCS, results: Results | None = None) -> list[str]:
    """One line per generated table that disagrees with its results file(s), or per table no page holds."""
    results = results or Results()
    problems, seen = [], set()
    for page in docs:
        text = page.read_text()
        seen |= {m.group("name") for m in BLOCK.finditer(text)}
        try:
            stale = stale_tables(text, results)
        except UnknownTable as e:
            problems.append(f"{page.name}: {e}")
            continue
        problems += [f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}: table {name!r} differs from its "
                     f"results file; run python -m benchmarks.tables" for name in stale]
    problems += [f"table {name!r} is in no docs page" for name in TABLES if name not in seen]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 naming each table that differs")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    results = Results()
    for page in DOCS:
        text = page.read_text()
        new = render(text, results)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
