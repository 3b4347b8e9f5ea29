"""What every generated docs table shares: reading a results file, saying where its numbers came from, formatting.

A results file says which build made it in one of several shapes, newest first:

- a top-level ``meta`` object, as ``benchmarks.results_io`` writes it (``git_commit``, ``git_dirty``,
  ``started``, ``ended``, ``command``; ``commit`` and ``dirty`` are read too);
- top-level ``commit`` / ``dirty`` / ``started`` or ``date`` (``churn.json``, ``mutation.json``, ``bandwidth_cap.json``);
- an ``environment`` object with ``commit`` or ``git`` and ``started`` (``byzantine``, ``convergence``, ``scale``);
- a list of such ``environment`` objects, one per run merged into the file (``thin20_race_e64c396.json``).

:func:`provenance` reads whichever is there; a file with none says "commit not recorded". Dates are
``YYYY-MM-DD`` (UTC for epoch seconds); a file that records no date says "date not recorded".
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Provenance:
    """Where one results file's numbers came from, as far as the file says."""

    path: str  # relative to the repository root
    commits: tuple[str, ...]  # short hashes, in the order the file lists them
    dirty: bool | None
    date: str | None
    scale: str | None = None  # the suite's scale (quick, full) that made it, where it says


    def text(self) -> str:
        """``benchmarks/results/x.json`` (commit 1a2b3c4, 2026-11-25), or what is not recorded."""
        if self.commits:
            commit = ("commit " if len(self.commits) == 1 else "commits ") + ", ".join(self.commits)
            if self.dirty:
                commit += " with uncommitted changes"
        else:
            commit = "commit not recorded"
        scale = f", {self.scale} scale" if self.scale else ""
        return f"`{self.path}` ({commit}, {self.date or 'date not recorded'}{scale})"


def _date(value: Any) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return dt.datetime.fromtimestamp(value, tz=dt.timezone.utc).strftime("%Y-%m-%d")
    if isinstance(value, str) and len(value) >= 10 and value[4] == "-" and value[7] == "-":
        return value[:10]
    return None


def _record(meta: dict[str, Any]) -> tuple[list[str], bool | None, str | None]:
    if meta.get("code_commit"):  # a run on a borrowed machine from a committed copy whose own .git was stale
        return [str(meta["code_commit"])[:7]], False, _date(meta.get("started", meta.get("date")))
    commit = meta.get("git_commit") or meta.get("commit") or meta.get("git")
    commits = [str(commit)[:7]] if commit else []
    flag = meta.get("git_dirty", meta.get("dirty"))
    dirty = flag if isinstance(flag, bool) else None
    return commits, dirty, _date(meta.get("started", meta.get("date")))


class Results:
    """The results files of one folder (``benchmarks/results`` unless a test points elsewhere)."""

    def __init__(self, folder: Path = RESULTS) -> None:
        self.folder = folder
        self._cache: dict[str, dict[str, Any]] = {}

    def load(self, name: str) -> dict[str, Any]:
        """The parsed JSON of ``name`` (e.g. ``"frontier.json"``)."""
        if name not in self._cache:
            self._cache[name] = json.loads((self.folder / name).read_text())
        return self._cache[name]

    def provenance(self, name: str) -> Provenance:
        data = self.load(name)
        if isinstance(data.get("meta"), dict):
            shapes = [data["meta"]]
        elif isinstance(data.get("meta"), list):  # files merged from runs made side by side
            shapes = [m for m in data["meta"] if isinstance(m, dict)]
        elif "commit" in data or "date" in data or "started" in data:
            shapes = [data]
        elif isinstance(data.get("environment"), dict):
            shapes = [data["environment"]]
        elif isinstance(data.get("environment"), list):
            shapes = [e for e in data["environment"] if isinstance(e, dict)]
        else:
            shapes = []
        commits: list[str] = []
        dirty: bool | None = None
        dates: list[str] = []
        for meta in shapes:
            c, d, date = _record(meta)
            commits += [x for x in c if x not in commits]
            dirty = d if dirty is None else (dirty or bool(d))
            dates += [date] if date else []
        span = None
        if dates:
            span = min(dates) if min(dates) == max(dates) else f"{min(dates)} to {max(dates)}"
        scales = sorted({str(m["scale"]) for m in shapes if m.get("scale")})
        return Provenance(f"benchmarks/results/{name}", tuple(commits), dirty, span, "/".join(scales) or None)

    def caption(self, *names: str, what: str = "") -> str:
        """The line above a generated table: its files, their commits and dates, and what it shows."""
        sources = "; ".join(self.provenance(n).text() for n in names)
        return f"Source: {sources}." + (f" {what}" if what else "")


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def loss(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def pct(x: float | None) -> str:
    """A relative change, ``+2.1 %``."""
    return "–" if x is None else f"{100 * x:+.1f} %"


def times(x: float | None, digits: int | None = None) -> str:
    """A ratio: ``digits`` decimals if given, else ``0.45×``, ``3.7×``, ``14×`` (two decimals below 1, one below 10)."""
    if x is None:
        return "–"
    if digits is None:
        digits = 2 if x < 1 else 1 if x < 10 else 0
    return f"{x:.{digits}f}×"


def size(b: float | None) -> str:
    """Bytes with three significant digits: ``60.8 MB``, ``1.06 MB``, ``619 kB``."""
    if b is None:
        return "–"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= div:
            return f"{_sig3(b / div)} {unit}"
    return f"{b:.0f} B"


def _sig3(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def seconds(s: float | None) -> str:
    return "not reached" if s is None else f"{s:.0f} s"


def share(x: float | None) -> str:
    """A fraction as a percentage, ``21 %`` (one decimal below 10 %)."""
    if x is None:
        return "–"
    return f"{100 * x:.1f} %" if x < 0.1 else f"{100 * x:.0f} %"


def mean_std(rec: dict[str, Any], field: str, fmt: str = "{:.3f}") -> str:
    """``mean ± std`` of a field over the seeds (``benchmarks.convergence_report.combine_seeds``), or the single value."""
    s = rec.get("spread", {}).get(field)
    if s is None:
        value = rec.get(field)
        return "–" if value is None else fmt.format(value)
    return f"{fmt.format(s['mean'])} ± {fmt.format(s['std'])}"
