"""The README's table "What an agent program can and cannot do" names, row by row, the tests that show it: each named
test exists (a renamed or removed test makes the row false, and this fails), and every row names at least one."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def table_rows() -> list[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## What an agent program can and cannot do"):]
    section = section[:section.index("\n## ", 3)]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| a program")]


def named_file(name: str) -> Path:
    found = [path for path in (REPO / "tests").rglob(Path(name).name) if path.as_posix().endswith(name)]
    assert len(found) == 1, f"the README names {name}, which is {'not one' if found else 'no'} test file"
    return found[0]


def test_every_row_names_tests_that_exist():
    rows = table_rows()
    assert len(rows) >= 25
    for row in rows:
        shown_by = row.rstrip(" |").rsplit(" | ", 1)[1]
        named = re.findall(r"`((?:\w+/)*test_\w+\.py)(?:::(\w+))?`", shown_by)
        assert named, f"a row names no test: {row[:100]}"
        for file, test in named:
            source = named_file(file).read_text(encoding="utf-8")
            if test:
                assert re.search(rf"^def {test}\(", source, re.M), f"{file} has no test {test} (README: {row[:80]})"
