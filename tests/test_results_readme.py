"""benchmarks/results/: every table and file the READMEs cite is in the tree, and every row
JSON carries its provenance (machine, date, commit, command, numbers)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CITED = re.compile(r"([a-z0-9]+(?:-[a-z0-9]+)*-h200(?:x2)?)/([A-Za-z0-9._-]*)")


def _cited(text: str) -> set[tuple[str, str]]:
    return {(m.group(1), m.group(2)) for m in CITED.finditer(text)}


def test_cited_tables_and_files_exist():
    missing = []
    for readme in (RESULTS / "README.md", ROOT / "README.md"):
        for table, name in _cited(readme.read_text()):
            path = RESULTS / table / name if name else RESULTS / table
            if not path.exists():
                missing.append(f"{readme.relative_to(ROOT)} cites {table}/{name}")
    assert not missing, "\n".join(sorted(missing))


def test_row_files_carry_their_provenance():
    bad = []
    for path in sorted(RESULTS.glob("*/*.json")):
        if path.parent.name == "plots":
            continue
        doc = json.loads(path.read_text())
        lacking = [k for k in ("machine", "date", "commit", "numbers") if not doc.get(k)]
        if lacking:
            bad.append(f"{path.relative_to(ROOT)}: no {', '.join(lacking)}")
    assert not bad, "\n".join(bad)


def test_citation_pattern_reads_table_and_file():
    assert _cited("see `peers-best-h200/` and peers-best-h200/losses.png") == {
        ("peers-best-h200", ""), ("peers-best-h200", "losses.png")}
