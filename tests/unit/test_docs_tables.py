"""The benchmark tables in docs/ are the ones their results files generate (``python -m benchmarks.tables``)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.table_format import RESULTS, Results
from benchmarks.tables import BLOCK, DOCS, TABLES, UnknownTable, check, render, stale_tables


def test_every_docs_table_matches_its_results_file() -> None:
    problems = check()
    assert not problems, "\n".join(problems)


def test_every_table_names_its_file_commit_and_date() -> None:
    results = Results()
    for name, build in TABLES.items():
        caption = build(results).splitlines()[0]
        assert caption.startswith("Source: `benchmarks/results/"), name
        assert "commit" in caption and re.search(r"\d{4}-\d{2}-\d{2}|date not recorded", caption), name


def _copy_results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    shutil.copytree(RESULTS, folder, ignore=shutil.ignore_patterns("*.png"))
    return folder


def test_a_changed_results_file_names_the_stale_table(tmp_path: Path) -> None:
    folder = _copy_results(tmp_path)
    data = json.loads((folder / "thin_nat.json").read_text())
    data["nat_cases"][0]["round_s_median"] += 1.0
    (folder / "thin_nat.json").write_text(json.dumps(data))
    text = DOCS[0].read_text()
    assert stale_tables(text, Results(folder)) == ["thin_nat"]


def test_a_table_edited_by_hand_is_named(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    fresh = render("<!-- table: frontier -->\n<!-- /table -->\n", Results())
    page.write_text(fresh.replace("| `q2` | 2.065", "| `q2` | 2.000"))
    problems = check((page,), Results())
    assert any("'frontier' differs" in p for p in problems)
    page.write_text(fresh)
    assert not any("'frontier'" in p for p in check((page,), Results()))


def test_meta_is_preferred_and_a_missing_commit_is_said(tmp_path: Path) -> None:
    folder = _copy_results(tmp_path)
    data = json.loads((folder / "thin_nat.json").read_text())
    assert "commit not recorded" in Results(folder).caption("thin_nat.json")
    data["meta"] = {"commit": "0123456789abcdef", "dirty": True, "started": "2027-01-02T03:04:05Z",
                    "ended": "2027-01-02T04:00:00Z", "command": "python -m benchmarks.thin_links --nat"}
    (folder / "thin_nat.json").write_text(json.dumps(data))
    caption = Results(folder).caption("thin_nat.json")
    assert "commit 0123456 with uncommitted changes, 2027-01-02" in caption


def test_the_meta_that_results_io_writes_names_its_commit(tmp_path: Path) -> None:
    from benchmarks import results_io

    folder = _copy_results(tmp_path)
    data = {k: v for k, v in json.loads((folder / "thin_nat.json").read_text()).items() if k != "meta"}
    results_io.write(folder / "thin_nat.json", data, results_io.begin(["python", "-m", "benchmarks.thin_links"]))
    meta = json.loads((folder / "thin_nat.json").read_text())["meta"]
    caption = Results(folder).caption("thin_nat.json")
    assert meta["git_commit"] and f"commit {meta['git_commit'][:7]}" in caption, caption


def test_epoch_seconds_and_several_environments_read_as_dates_and_commits() -> None:
    results = Results()
    assert results.provenance("churn.json").date == "2026-11-25"  # "started" in epoch seconds
    race = results.provenance("thin20_race_e64c396.json")  # one environment per merged run
    assert race.commits == ("e64c396",) and race.date == "2026-11-25"


def test_an_unknown_table_is_refused() -> None:
    with pytest.raises(UnknownTable, match="nope"):
        render("<!-- table: nope -->\n<!-- /table -->", Results())


def test_every_registered_table_is_in_a_docs_page() -> None:
    names = {m.group("name") for page in DOCS for m in BLOCK.finditer(page.read_text())}
    assert names == set(TABLES)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_links_between_readme_and_docs_resolve() -> None:
    root = DOCS[0].parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", page.read_text()):
            path, anchor = target
            if path.startswith("http"):
                continue
            linked = (page.parent / path) if path else page
            assert linked.exists(), f"{page.name}: link to missing {path}"
            if anchor:
                assert anchor in _anchors(linked.read_text()), f"{page.name}: no heading #{anchor} in {linked.name}"
