"""docs/benchmarks/: every result file names its run (command, commit, date, machine) and is linked from a page;
every figure row of the index names a machine the page describes."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "benchmarks"


def _machines() -> set[str]:
    index = (BENCH / "index.md").read_text(encoding="utf-8")
    section = index.split("## Machines", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w-]+)` \|", section, re.MULTILINE))


def test_every_result_names_its_run_and_is_linked_from_a_page():
    machines = _machines()
    pages = "\n".join(p.read_text(encoding="utf-8") for p in BENCH.rglob("*.md"))
    results = sorted((BENCH / "results").glob("*.json"))
    assert len(results) > 10
    for path in results:
        run = json.loads(path.read_text(encoding="utf-8"))
        assert run["command"] and run["rows"], f"{path.name}: no command or no rows"
        assert re.fullmatch(r"[0-9a-f]{7,40}", run["commit"]), f"{path.name}: commit {run['commit']!r}"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", run["date"]), f"{path.name}: date {run['date']!r}"
        assert run["machine"] in machines, f"{path.name}: machine {run['machine']!r} is not on the index"
        assert all(set(r) <= set(run["columns"]) for r in run["rows"]), f"{path.name}: a row off the columns"
        assert f"results/{path.name})" in pages, f"{path.name} is linked from no benchmarks page"


def test_every_figure_row_names_its_commit_date_and_a_described_machine():
    machines = _machines()
    rows = [ln for ln in (BENCH / "index.md").read_text(encoding="utf-8").splitlines() if ln.count(" | ") >= 5]
    figure_rows = [ln for ln in rows if not ln.startswith(("| what |", "| --- |"))]
    assert len(figure_rows) > 20
    for ln in figure_rows:
        run = ln.rstrip(" |").rsplit(" | ", 1)[1]
        m = re.match(r"^([0-9a-f]{7}), (\d{4}-\d\d-\d\d), `([\w-]+)`, \[(json|note)\]\(", run)
        assert m, f"a row without 'commit, date, machine, link': {ln[:80]}"
        assert m.group(3) in machines, f"machine {m.group(3)} is not described: {ln[:80]}"
