"""A lock is held again, wherever it is read, to every check ``freeze`` made: its names can be folders of the runs
folder and no more, its records are of the paths its protocol names, its limits hold against its parents.

Each lock here is edited by hand the way a forger would, its ``protocol_sha256`` recomputed so that it agrees with
itself; each is refused in one sentence naming the lock and the key (exit 2), by ``verify`` and by every command
that reads a lock, before any folder or file is made.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from opalctl.files import canonical_json
from opalctl.protocol.lock import protocol_digest
from tests.support.cli import call_cli

LOCK_NAME = "digits.lock.json"


def freeze(project: Path) -> Path:
    result = call_cli("freeze", project / "digits.yaml")
    assert result.code == 0, result.output
    return project / LOCK_NAME


def edited(lock_path: Path, edit) -> Path:
    """The lock with ``edit(lock)`` applied and its protocol's digest recomputed (it agrees with itself)."""
    lock = json.loads(lock_path.read_text(encoding="utf-8"))
    edit(lock)
    if isinstance(lock.get("protocol"), dict):
        lock["protocol_sha256"] = protocol_digest(lock["protocol"])
    lock_path.write_text(canonical_json(lock), encoding="utf-8")
    return lock_path


def everything_under(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def readers(lock: Path, runs: Path, out: Path) -> dict[str, tuple]:
    """Every command that reads a lock, pointed at ``runs`` (and ``out`` for what export writes)."""
    return {"verify": ("verify", lock), "verify --runs": ("verify", lock, "--runs", "--runs-dir", runs),
            "run": ("run", lock, "--arm", "adamw", "--seed", "1", "--runs-dir", runs),
            "grid": ("grid", lock, "--runs-dir", runs, "--jobs", "1"),
            "compare": ("compare", lock, "--runs-dir", runs), "report": ("report", lock, "--runs-dir", runs),
            "export": ("export", lock, "--runs-dir", runs, "--tensorboard", out)}


def assert_one_sentence(result, lock: Path, *words: str, code: int = 2) -> None:
    assert result.code == code, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"opalctl: error: lock {lock}"), result.stderr
    for word in words:
        assert word in first, first


# --------------------------------------------------------------------------------------------------------------
# names


@pytest.mark.parametrize("arm", ["report.html", "anchors", "5", "1e3", "nan", "true", "0x1F", "_x"])
def test_freeze_refuses_an_arm_named_as_a_file_opalctl_writes_or_as_a_number(digits_project, arm):
    """``report.html`` and ``anchors`` lie beside the arms' folders; ``5``, ``1e3``, ``nan``, ``true`` read back as
    other values than the name (quoted here, so YAML gives the schema the string)."""
    text = (digits_project / "digits.yaml").read_text(encoding="utf-8")
    (digits_project / "digits.yaml").write_text(text.replace("  adamw-long:", f"  {json.dumps(arm)}:"),
                                                encoding="utf-8")
    result = call_cli("freeze", digits_project / "digits.yaml")
    assert result.code == 2, result.output
    assert result.stderr.count("\n") == 1 and f"arms.{arm}" in result.stderr.replace("'", ""), result.stderr
    assert not (digits_project / LOCK_NAME).exists()


@pytest.mark.parametrize("arm", ["../../x", "/tmp/elsewhere-x", "report.html", "anchors", "5", "nan"])
def test_a_lock_whose_arm_was_renamed_by_hand_is_refused_by_every_reader_before_any_folder_is_made(
        digits_project, tmp_path, arm):
    lock = edited(freeze(digits_project),
                  lambda data: data["protocol"]["arms"].__setitem__(arm, data["protocol"]["arms"].pop("adamw-long")))
    runs, out, before = tmp_path / "runs", tmp_path / "tb", everything_under(tmp_path)
    for name, command in readers(lock, runs, out).items():
        result = call_cli(*command)
        assert_one_sentence(result, lock, "arm", repr(arm))
        assert everything_under(tmp_path) == before, f"{name} wrote {set(everything_under(tmp_path)) - set(before)}"
    assert not Path("/tmp/elsewhere-x").exists()


@pytest.mark.parametrize("name", ["5", "anchors", "1e3"])
def test_a_lock_renamed_by_hand_to_a_number_or_a_reserved_name_is_refused(digits_project, tmp_path,
                                                                          name):
    def rename(data):
        data["name"] = data["protocol"]["name"] = name

    lock = edited(freeze(digits_project), rename)
    for command in readers(lock, tmp_path / "runs", tmp_path / "tb").values():
        assert_one_sentence(call_cli(*command), lock, repr(name))
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------------------------------------------
# records tied to the protocol, limits held against the parent


def repoint_selection_at_the_training_rows(data):
    data["protocol"]["data"]["selection"] = data["protocol"]["data"]["train"]


def test_a_split_repointed_at_the_training_rows_is_refused_though_every_record_still_matches(
        digits_project, tmp_path):
    """The issue's case: the split is read from the protocol, and each record checks only its own path, so
    ``verify`` said 0 and a run would judge on training rows."""
    lock = edited(freeze(digits_project), repoint_selection_at_the_training_rows)
    before = everything_under(tmp_path)
    for name, command in readers(lock, tmp_path / "runs", tmp_path / "tb").items():
        result = call_cli(*command)
        assert_one_sentence(result, lock, "data.selection", "data/digits/train.npz", "data/digits/selection.npz")
        assert everything_under(tmp_path) == before, name
    assert call_cli("verify", lock).stderr.count("\n") == 1, "one line"


def test_checkpoint_bytes_below_the_parents_size_is_refused_up_front_not_after_training(digits_project,
                                                                                         tmp_path):
    lock_path = freeze(digits_project)
    parent = os.path.getsize(digits_project / "parents/digits/seed-1.pt")

    def shrink(data):
        data["protocol"]["limits"]["checkpoint_bytes"] = parent - 1

    lock = edited(lock_path, shrink)
    before = everything_under(tmp_path)
    for command in readers(lock, tmp_path / "runs", tmp_path / "tb").values():
        result = call_cli(*command)
        assert_one_sentence(result, lock, "limits.checkpoint_bytes", str(parent - 1), f"{parent} bytes")
    assert everything_under(tmp_path) == before


@pytest.mark.parametrize("edit, key", [
    (lambda data: data["records"].pop("data.development"), "data.development"),
    (lambda data: data["records"]["data.retention"].update(path="data/digits/train.npz"), "data.retention"),
    (lambda data: data["records"]["parent.seed-2"].update(path="parents/digits/seed-1.pt"), "parents"),
    (lambda data: data["records"].__setitem__("data.extra", dict(data["records"]["data.train"])),
     "records.data.extra"),
    (lambda data: data["records"]["protocol"].update(path="../elsewhere.yaml"), "records.protocol"),
    (lambda data: data["records"].pop("source.task"), "records.source.task"),
], ids=["record-missing", "record-of-another-split", "record-of-another-parent", "record-of-no-split",
        "protocol-elsewhere", "no-task-source"])
def test_a_record_that_is_not_of_the_path_the_protocol_names_is_refused(digits_project, tmp_path,
                                                                        edit, key):
    lock = edited(freeze(digits_project), edit)
    assert_one_sentence(call_cli("verify", lock), lock, key)
    result = call_cli("run", lock, "--arm", "adamw", "--seed", "1", "--runs-dir", tmp_path / "runs")
    assert_one_sentence(result, lock, key)
    assert not (tmp_path / "runs").exists()


def test_a_lock_edited_and_its_digest_left_alone_is_still_a_change_under_verify(digits_project):
    """The re-check never hides a change: a protocol that no longer matches its digest is listed as changed (exit 3),
    whatever else is wrong with it."""
    lock_path = freeze(digits_project)
    lock = json.loads(lock_path.read_text(encoding="utf-8"))
    repoint_selection_at_the_training_rows(lock)
    lock_path.write_text(canonical_json(lock), encoding="utf-8")
    result = call_cli("verify", lock_path, "--json")
    assert result.code == 3, result.output
    assert [(p["role"], p["status"]) for p in result.json()["problems"]] == [("lock.protocol", "changed")]


# --------------------------------------------------------------------------------------------------------------
# shapes


@pytest.mark.parametrize("edit, key", [
    (lambda data: data["protocol"].__setitem__("arms", 5), "protocol.arms"),
    (lambda data: data.__setitem__("protocol", [1, 2]), "protocol"),
    (lambda data: data["records"]["data.train"].pop("sha256"), "records.data.train"),
    (lambda data: data["records"]["data.train"].__setitem__("bytes", "many"), "records.data.train.bytes"),
    (lambda data: data.__setitem__("records", []), "records"),
    (lambda data: data["records"].__setitem__("source.task", None), "records.source.task"),
    (lambda data: data["protocol"].__setitem__("seeds", {"1": 1}), "seeds"),
], ids=["arms-an-int", "protocol-a-list", "record-without-sha256", "bytes-a-string", "records-a-list",
        "record-null", "seeds-an-object"])
def test_a_lock_of_another_shape_is_one_sentence_naming_the_key(digits_project, tmp_path, edit, key):
    lock = edited(freeze(digits_project), edit)
    for command in readers(lock, tmp_path / "runs", tmp_path / "tb").values():
        assert_one_sentence(call_cli(*command), lock, f"{key}: ")
    assert not (tmp_path / "runs").exists()
