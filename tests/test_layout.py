"""opalctl/layout.py: every name of a lock's run folders, where a run stands by its files, and the names of locks
and arms that cannot be folders refused before any folder is made."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import opalctl
from opalctl.errors import BadInput
from opalctl.layout import AT_UPDATE_0, FINISHED, NEW, RESUMABLE, STARTED, LockRuns, RunLayout


@dataclass
class FakeLock:
    name: object
    sha12: str = "0123456789ab"
    path: Path = Path("x.lock.json")


def test_a_runs_every_name_lies_where_the_layout_says(tmp_path):
    runs = LockRuns.of(tmp_path, FakeLock("digits"))
    layout = runs.run("adamw", 2)
    base = tmp_path / "digits-0123456789ab"
    assert layout.root == base / "adamw" / "seed-2" and layout.anchor.record == base / "anchors" / "seed-2" / \
        "anchor.json"
    assert layout.stage_checkpoint(3) == layout.root / "training" / "stage-03.pt"
    assert layout.stage_record(3) == layout.root / "stage-03.json" and layout.report == layout.root / "report.json"
    assert layout.opal == layout.root / "training" / "opal" and layout.workspace == layout.root / "agent" / "workspace"
    assert layout.folder_lock == base / "adamw" / ".seed-2.lock"
    assert layout.name_of(layout.stage_checkpoint(1)) == "training/stage-01.pt"
    assert layout.name_of(layout.anchor.record) == "../../anchors/seed-2/anchor.json"
    assert layout.path_of("training/stage-01.pt") == layout.stage_checkpoint(1)
    with pytest.raises(ValueError):
        layout.path_of("../../elsewhere")


@pytest.mark.parametrize("name", ["../../elsewhere/x", "/abs", "..", ".hidden", "-flag", "a b", 5, None, ""])
def test_a_lock_or_arm_name_that_cannot_be_a_folder_is_refused_before_any_folder_is_made(tmp_path, name):
    with pytest.raises(BadInput, match="cannot name a folder"):
        LockRuns.of(tmp_path, FakeLock(name))
    with pytest.raises(BadInput, match="cannot name a folder"):
        LockRuns.of(tmp_path, FakeLock("digits")).run(name, 1)
    assert list(tmp_path.iterdir()) == []


def test_where_a_run_stands_is_decided_by_its_files(tmp_path):
    layout = RunLayout(tmp_path / "run")
    assert layout.state == NEW and not layout.is_run_folder()
    layout.training.mkdir(parents=True)
    layout.start.write_text("{}")
    assert layout.state == AT_UPDATE_0
    layout.steps.write_bytes(b"")
    assert layout.state == AT_UPDATE_0, "an empty steps file counts no update"
    layout.steps.write_bytes(b"\x1f\x8b-some lines")
    assert layout.state == STARTED
    layout.resume.write_bytes(b"checkpoint")
    assert layout.state == RESUMABLE
    layout.report.write_text("{}")
    assert layout.state == FINISHED and layout.is_run_folder()


def test_a_folder_made_before_training_existed_still_reads(tmp_path):
    layout = RunLayout(tmp_path / "run")
    layout.root.mkdir()
    (layout.root / "steps.jsonl.gz").write_bytes(b"")
    assert layout.legacy and layout.training == layout.root
    assert layout.stage_checkpoint(1) == layout.root / "stage-01.pt" and layout.opal == layout.root / "opal"
    (layout.root / "training").mkdir()
    assert not layout.legacy


def test_abandoned_attempts_are_numbered_after_the_highest(tmp_path):
    layout = RunLayout(tmp_path / "arm" / "seed-1")
    layout.root.mkdir(parents=True)
    assert layout.next_abandoned() == layout.root.parent / "seed-1.abandoned-1"
    (layout.root.parent / "seed-1.abandoned-1").mkdir()
    (layout.root.parent / "seed-1.abandoned-7").mkdir()
    (layout.root.parent / "seed-1.abandoned-x").mkdir()
    assert layout.abandoned() == [layout.root.parent / "seed-1.abandoned-1", layout.root.parent / "seed-1.abandoned-7"]
    assert layout.next_abandoned().name == "seed-1.abandoned-8"


def test_the_seeds_of_an_arm_are_its_numbered_run_folders_in_seed_order(tmp_path):
    runs = LockRuns.of(tmp_path, FakeLock("digits"))
    for name in ("seed-10", "seed-2", "seed-x", "notes"):
        (runs.base / "adamw" / name).mkdir(parents=True)
    assert [layout.root.name for layout in runs.seeds_of("adamw")] == ["seed-2", "seed-10"]


@pytest.mark.parametrize("name", ["anchors", "report.html", "5", "1e3", "1_000", "nan", "inf", "true", "null", "0x1F",
                                  "0o17", "x" * 65])
def test_a_name_that_is_opalctls_own_beside_the_arms_or_reads_as_another_value_is_refused(tmp_path, name):
    with pytest.raises(BadInput, match=r"opalctl writes beside the arms|reads as a number|cannot name a folder"):
        LockRuns.of(tmp_path, FakeLock("digits")).run(name, 1)
    with pytest.raises(BadInput):
        LockRuns.of(tmp_path, FakeLock(name))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["agent", "adamw-cosine", "stage-2", "seed-3", "grid.log", "v1.5", "e5x", "Nano"])
def test_ordinary_names_stay_names(tmp_path, name):
    """Only what lies beside the arms' folders is reserved: an arm named like a file of a run folder is fine, since
    each run folder lies one level below its arm's."""
    assert LockRuns.of(tmp_path, FakeLock(name)).run(name, 1).root == tmp_path / f"{name}-0123456789ab" / name / \
        "seed-1"


def test_the_agent_optimizers_records_lie_where_the_layout_says(tmp_path):
    layout = LockRuns.of(tmp_path, FakeLock("digits")).run("agent", 1)
    assert layout.events == layout.root / "training" / "opal" / "events.jsonl"
    assert layout.hung == layout.root / "training" / "opal" / "hung.jsonl"
    assert layout.program_version(3) == layout.root / "training" / "opal" / "programs" / "v003"


# a file's name as a whole string literal, and the one module allowed to spell it (its definition); a message that
# names a file inside a sentence is not such a literal, and the folders' names (decisions, programs, workspace) are
# left out: they are keys of records and messages too
NAMED_ONCE = {"start.json": "layout.py", "initial.pt": "layout.py", "last.json": "layout.py",
              "selected.json": "layout.py", "report.json": "layout.py", "resume.pt": "layout.py",
              "steps.jsonl.gz": "layout.py", "anchor.json": "layout.py", "report.html": "layout.py",
              "events.jsonl": "layout.py", "losses.jsonl": "layout.py", "reports.jsonl": "layout.py",
              "hung.jsonl": "layout.py",
              "message.md": "opal/records.py", "response.md": "opal/records.py", "facts.json": "opal/records.py",
              "transcript.json": "opal/records.py", "meta.json": "opal/records.py", "answer.json": "opal/records.py",
              "updater.py": "opal/programs.py", "analysis.py": "opal/programs.py"}
# messages.py is among the released defaults, whose digest every run records (opal/provenance.py): left as it is
NOT_READ = {"opal/messages.py"}


def _literals(tree: ast.AST) -> Iterator[ast.Constant]:
    """The string constants of a module that are neither a docstring nor a part of an f-string."""
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in node.values)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node


def test_no_file_of_a_run_folder_is_named_by_hand_outside_its_definition():
    package = Path(opalctl.__file__).parent
    spelled = []
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module in NOT_READ:
            continue
        for node in _literals(ast.parse(path.read_text(encoding="utf-8"))):
            owner = NAMED_ONCE.get(node.value)
            if owner is not None and module != owner:
                spelled.append(f"{module}:{node.lineno} {node.value!r} (named in {owner})")
    assert spelled == []
