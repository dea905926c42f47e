"""A run folder of the format before issue 29 (written at commit 029fb15, tests/data/format_029fb15) reads as it
did then: ``show``, ``verify`` and ``compare`` print what they printed at that commit, as JSON and as text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.cli import call_cli

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "format_029fb15"
RUNS = "runs_dir/digits-586d962ba73c"
ARMS = ("adamw", "high")


@pytest.fixture
def old_folder(tmp_path, monkeypatch) -> Path:
    """A copy of the old run folders, the working folder (the expected outputs name them relatively)."""
    copy = tmp_path / "old"
    shutil.copytree(FIXTURE, copy, ignore=shutil.ignore_patterns("expected", "README.md"))
    monkeypatch.chdir(copy)
    return copy


def expected(name: str) -> str:
    return (FIXTURE / "expected" / name).read_text()


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("command", ["show", "verify"])
def test_show_and_verify_read_a_run_folder_of_the_previous_format_as_before(old_folder, command, arm):
    run_dir = f"{RUNS}/{arm}/seed-1"
    as_json = call_cli(command, run_dir, "--json")
    assert as_json.code == 0, as_json.output
    assert as_json.json() == json.loads(expected(f"{command}-{arm}.json"))
    as_text = call_cli(command, run_dir)
    assert as_text.code == 0 and as_text.stdout == expected(f"{command}-{arm}.txt"), as_text.output


def test_compare_reads_the_runs_of_the_previous_format_as_before(old_folder):
    as_json = call_cli("compare", "digits.lock.json", "--runs-dir", "runs_dir", "--json")
    assert as_json.code == 0, as_json.output
    assert as_json.json() == json.loads(expected("compare.json"))
    as_text = call_cli("compare", "digits.lock.json", "--runs-dir", "runs_dir")
    assert as_text.code == 0 and as_text.stdout == expected("compare.txt"), as_text.output


def test_the_old_folder_holds_both_kinds_of_selected_record():
    """The fixture covers both shapes of ``selected.json``: the anchor (flagged, with a reason) and a stage."""
    selected = {arm: json.loads((FIXTURE / RUNS / arm / "seed-1" / "selected.json").read_text()) for arm in ARMS}
    assert selected["adamw"]["source"] == "anchor" and "reason" in selected["adamw"]
    assert selected["high"]["source"] == "stage" and "reason" not in selected["high"]
