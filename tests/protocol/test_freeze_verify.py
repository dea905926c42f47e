"""``freeze`` writes a canonical lock of every input; ``verify`` names each input that changed, and exits 3.

Every role the lock records is broken once: a data split, a parent, the protocol file, the task's own source
file (a task module written here, outside opalctl) and a module of opalctl itself. The installed package is never
edited: its change is simulated by a lock whose record of the module holds another digest (or size), and an added
package file by a lock that lacks the record of one.

Records of the project's own files are paths relative to the lock; opalctl's files are relative to the installed
package (``"base": "opalctl"``) and a task module outside both is found again by its module name (``"base":
"module"``), so a project folder can be moved to any depth and still verify.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import pytest

import opalctl
from opalctl.files import canonical_json
from opalctl.protocol.freeze import package_files
from opalctl.protocol.lock import read_lock as load_lock
from tests import support
from tests.support.cli import call_cli, run_cli

LOCK_NAME = "digits.lock.json"


def freeze(project: Path) -> dict:
    result = call_cli("freeze", project / "digits.yaml", "--json")
    assert result.code == 0, result.output
    return result.json()


def read_lock(project: Path) -> dict:
    return json.loads((project / LOCK_NAME).read_text(encoding="utf-8"))


def verify(lock: Path, *flags):
    return call_cli("verify", lock, *flags)


def write_lock(path: Path, lock: dict) -> Path:
    path.write_text(canonical_json(lock), encoding="utf-8")
    return path


PACKAGE = Path(opalctl.__file__).resolve().parent


def assert_reported(result, role: str, path: str, status: str):
    """Exit 3, the role and path named in the human output, and exactly this one problem."""
    assert result.code == 3, result.output
    row = [line for line in result.stdout.splitlines() if line.startswith(role + " ")]
    assert row, f"{role} not listed:\n{result.stdout}"
    assert path in row[0] and row[0].rstrip().endswith(status), row[0]
    assert result.stdout.startswith("1 changed input(s) in "), result.stdout
    assert "restore the files listed" in result.stderr
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------------------------------------------
# verify


def test_an_unchanged_project_verifies(digits_project):
    frozen = freeze(digits_project)
    result = verify(digits_project / LOCK_NAME)  # a real process's exit 0: the moved project's test below
    assert result.code == 0, result.output
    assert result.stdout.startswith(f"ok: {frozen['records']} records of ")
    report = verify(digits_project / LOCK_NAME, "--json")
    assert report.code == 0
    body = report.json()
    assert body["ok"] is True and body["problems"] == [] and body["checked"] == frozen["records"]
    assert body["sha256"] == frozen["sha256"]


ROLES = [
    ("data.train", "data/digits/train.npz"),
    ("data.development", "data/digits/development.npz"),
    ("data.selection", "data/digits/selection.npz"),
    ("data.retention", "data/digits/retention.npz"),
    ("parent.seed-1", "parents/digits/seed-1.pt"),
    ("parent.seed-2", "parents/digits/seed-2.pt"),
    ("protocol", "digits.yaml"),
]


@pytest.mark.parametrize("role, relative", ROLES, ids=[r for r, _ in ROLES])
def test_one_flipped_byte_is_named_with_exit_3(digits_project, role, relative):
    freeze(digits_project)
    assert read_lock(digits_project)["records"][role]["path"] == relative
    support.flip_byte(digits_project / relative)
    assert_reported(verify(digits_project / LOCK_NAME), role, relative, "changed")
    body = verify(digits_project / LOCK_NAME, "--json")
    assert body.code == 3
    problems = body.json()["problems"]
    assert [(p["role"], p["path"], p["status"]) for p in problems] == [(role, relative, "changed")]
    assert problems[0]["sha256"] != problems[0]["expected_sha256"]


def test_the_real_command_exits_3_naming_a_changed_parent(digits_project):
    freeze(digits_project)
    support.flip_byte(digits_project / "parents/digits/seed-2.pt", offset=100)
    result = run_cli("verify", digits_project / LOCK_NAME)
    assert_reported(result, "parent.seed-2", "parents/digits/seed-2.pt", "changed")


MYTASK = '''"""A task defined outside opalctl: its source file is a record of the lock like any other."""

from opalctl.tasks.digits import Digits


class MyDigits(Digits):
    """The built-in digits task under another name, from a module of the user's own."""
'''


@pytest.fixture
def task_module(monkeypatch, request):
    """``task_module(project, folder, name)``: write the module ``name`` (a copy of MYTASK) into ``folder``, put
    ``folder`` on sys.path for this test, and point the project's protocol at ``name:MyDigits``. Each test uses its
    own module name, and the module is dropped from sys.modules afterwards."""

    def use(project: Path, folder: Path, name: str) -> Path:
        module = folder / f"{name}.py"
        module.write_text(MYTASK, encoding="utf-8")
        monkeypatch.syspath_prepend(str(folder))
        request.addfinalizer(lambda: sys.modules.pop(name, None))
        protocol = project / "digits.yaml"
        protocol.write_text(protocol.read_text(encoding="utf-8").replace("opalctl.tasks.digits:Digits",
                                                                         f"{name}:MyDigits"), encoding="utf-8")
        return module

    return use


def test_a_changed_task_source_file_is_named(digits_project, tmp_path, task_module):
    """A task module outside the project and the package is recorded by module name and found again by import."""
    modules = tmp_path / "modules"
    modules.mkdir()
    module = task_module(digits_project, modules, "mytask_outside")
    freeze(digits_project)
    record = read_lock(digits_project)["records"]["source.task"]
    assert record == {"base": "module", "module": "mytask_outside", "path": "mytask_outside.py",
                      "bytes": module.stat().st_size, "sha256": support.sha256_of(module)}
    lock = digits_project / LOCK_NAME
    assert verify(lock).code == 0

    support.flip_byte(module)
    assert_reported(verify(lock), "source.task", str(module.resolve()), "changed")
    # a real process finds the module through its own path
    assert_reported(run_cli("verify", lock, env={"PYTHONPATH": str(modules)}), "source.task", str(module.resolve()),
                    "changed")


def test_a_task_module_that_cannot_be_imported_at_verify_time_is_missing(digits_project, tmp_path, task_module,
                                                                         monkeypatch):
    modules = tmp_path / "modules"
    modules.mkdir()
    task_module(digits_project, modules, "mytask_missing")
    freeze(digits_project)
    monkeypatch.undo()  # the module's folder leaves sys.path, and the module sys.modules
    sys.modules.pop("mytask_missing", None)
    importlib.invalidate_caches()
    result = verify(digits_project / LOCK_NAME, "--json")
    assert result.code == 3, result.output
    assert [(p["role"], p["path"], p["status"]) for p in result.json()["problems"]] == [
        ("source.task", "<module mytask_missing not importable>", "missing")]


def test_a_task_module_inside_the_project_is_relative_to_the_lock(digits_project, task_module):
    module = task_module(digits_project, digits_project, "mytask_inside")
    freeze(digits_project)
    record = read_lock(digits_project)["records"]["source.task"]
    assert record == {"path": "mytask_inside.py", "bytes": module.stat().st_size, "sha256": support.sha256_of(module)}
    lock = digits_project / LOCK_NAME
    assert verify(lock).code == 0

    support.flip_byte(module)
    assert_reported(verify(lock), "source.task", "mytask_inside.py", "changed")
    # read from beside the lock, not imported: a real process needs no PYTHONPATH
    assert_reported(run_cli("verify", lock), "source.task", "mytask_inside.py", "changed")


ROLE = "source.opalctl/protocol/recheck.py"


def test_opalctl_modules_are_recorded_relative_to_the_installed_package(digits_project):
    freeze(digits_project)
    record = read_lock(digits_project)["records"][ROLE]
    real = PACKAGE / "protocol" / "recheck.py"
    assert record == {"base": "opalctl", "path": "protocol/recheck.py", "bytes": real.stat().st_size,
                      "sha256": support.sha256_of(real)}
    assert load_lock(digits_project / LOCK_NAME).record_path(record) == real


@pytest.mark.parametrize("change, status", [("sha256", "changed"), ("bytes", "resized")])
def test_a_changed_opalctl_module_is_named(digits_project, change, status):
    """The installed package differs from the frozen one: simulated by a lock that froze another digest (or size)."""
    freeze(digits_project)
    lock = read_lock(digits_project)
    record = lock["records"][ROLE]
    if change == "sha256":
        record["sha256"] = hashlib.sha256(b"another verify.py").hexdigest()
    else:
        record["bytes"] += 1
    edited = write_lock(digits_project / LOCK_NAME, lock)
    result = run_cli("verify", edited)
    assert_reported(result, ROLE, str(PACKAGE / "protocol" / "recheck.py"), status)
    body = verify(edited, "--json")
    assert body.code == 3
    assert [(p["role"], p["path"], p["status"]) for p in body.json()["problems"]] == [
        (ROLE, str(PACKAGE / "protocol" / "recheck.py"), status)]


def test_an_opalctl_module_the_lock_does_not_record_is_reported_added(digits_project):
    """A package file that was not there when the protocol was frozen: simulated by a lock without its record."""
    freeze(digits_project)
    lock = read_lock(digits_project)
    del lock["records"][ROLE]
    edited = write_lock(digits_project / LOCK_NAME, lock)
    result = verify(edited, "--json")
    assert result.code == 3, result.output
    body = result.json()
    assert body["problems"] == [{"role": ROLE, "path": str(PACKAGE / "protocol" / "recheck.py"), "status": "added"}]
    assert body["checked"] == len(lock["records"])
    human = verify(edited)
    assert_reported(human, ROLE, str(PACKAGE / "protocol" / "recheck.py"), "added")


def test_an_opalctl_record_of_a_file_gone_from_the_package_is_missing(digits_project):
    freeze(digits_project)
    lock = read_lock(digits_project)
    record = dict(lock["records"][ROLE], path="protocol/no_such_module.py")
    lock["records"]["source.opalctl/protocol/no_such_module.py"] = record
    result = verify(write_lock(digits_project / LOCK_NAME, lock), "--json")
    assert result.code == 3
    assert [(p["role"], p["path"], p["status"]) for p in result.json()["problems"]] == [
        ("source.opalctl/protocol/no_such_module.py", str(PACKAGE / "protocol" / "no_such_module.py"), "missing")]


def test_a_missing_file_is_reported_missing(digits_project):
    freeze(digits_project)
    (digits_project / "data/digits/selection.npz").unlink()
    assert_reported(verify(digits_project / LOCK_NAME), "data.selection", "data/digits/selection.npz",
                    "missing")


@pytest.mark.parametrize("change", [b"x", -1], ids=["grown", "shrunk"])
def test_a_resized_file_is_reported_resized(digits_project, change):
    freeze(digits_project)
    path = digits_project / "data/digits/retention.npz"
    data = path.read_bytes()
    path.write_bytes(data + change if isinstance(change, bytes) else data[:change])
    result = verify(digits_project / LOCK_NAME, "--json")
    assert result.code == 3
    body = result.json()
    assert body["ok"] is False
    assert [(p["role"], p["status"], p["bytes"], p["expected_bytes"]) for p in body["problems"]] == [
        ("data.retention", "resized", len(data) + (1 if isinstance(change, bytes) else -1), len(data))]


def test_json_output_lists_every_problem_and_exits_3(digits_project):
    freeze(digits_project)
    support.flip_byte(digits_project / "data/digits/train.npz")
    (digits_project / "parents/digits/seed-1.pt").unlink()
    result = verify(digits_project / LOCK_NAME, "--json")
    assert result.code == 3
    body = result.json()  # stdout is one JSON document and nothing else
    assert body["ok"] is False and body["name"] == "digits"
    assert sorted((p["role"], p["path"], p["status"]) for p in body["problems"]) == [
        ("data.train", "data/digits/train.npz", "changed"),
        ("parent.seed-1", "parents/digits/seed-1.pt", "missing")]
    statuses = {r["role"]: r["status"] for r in body["records"]}
    assert statuses["data.train"] == "changed" and statuses["data.selection"] == "ok"


def test_a_hand_edited_lock_protocol_is_caught(digits_project):
    freeze(digits_project)
    lock = read_lock(digits_project)
    lock["protocol"]["budget"]["amount"] = 200.0
    (digits_project / LOCK_NAME).write_text(canonical_json(lock), encoding="utf-8")
    result = verify(digits_project / LOCK_NAME, "--json")
    assert result.code == 3
    assert [(p["role"], p["status"]) for p in result.json()["problems"]] == [("lock.protocol", "changed")]


@pytest.mark.parametrize("content, expected", [
    (None, "does not exist"),
    ("not json", "is not valid JSON"),
    ('{"format": "something-else"}', "is not an opalctl lock"),
    ('{"format": "opalctl-lock/1", "status": "draft"}', "not 'frozen'"),
    ('{"format": "opalctl-lock/1", "status": "frozen"}', "lacks the key"),
])
def test_a_bad_lock_is_bad_input(tmp_path, content, expected):
    lock = tmp_path / "x.lock.json"
    if content is not None:
        lock.write_text(content, encoding="utf-8")
    result = verify(lock)
    assert result.code == 2
    assert result.stderr.startswith("opalctl: error: ") and result.stderr.count("\n") == 1
    assert expected in result.stderr and str(lock) in result.stderr


@pytest.mark.parametrize("frozen_at, moved_to", [((), ("a", "b", "c")), (("a", "b", "c"), ())],
                         ids=["moved-deeper", "moved-shallower"])
def test_a_frozen_project_moved_to_another_depth_still_verifies(digits_project, tmp_path, monkeypatch, frozen_at,
                                                                moved_to):
    original = tmp_path.joinpath("frozen", *frozen_at, "project")
    shutil.copytree(digits_project, original)
    frozen = freeze(original)
    moved = tmp_path.joinpath("moved", *moved_to, "project")
    shutil.copytree(original, moved)
    shutil.rmtree(original)  # nothing may still be read from the old place
    result = verify(moved / LOCK_NAME, "--json")
    assert result.code == 0, result.stdout[:2000]
    assert result.json()["checked"] == frozen["records"] and result.json()["sha256"] == frozen["sha256"]
    if moved_to:  # and from a real process in another folder (once: each costs a torch import)
        assert run_cli("verify", moved / LOCK_NAME, cwd=moved).code == 0
    else:  # and in this process from the moved folder
        monkeypatch.chdir(moved)
        assert verify(Path(LOCK_NAME)).code == 0


def test_a_project_with_its_own_task_module_moved_to_another_depth_still_verifies(digits_project, tmp_path,
                                                                                task_module):
    task_module(digits_project, digits_project, "mytask_moved")
    freeze(digits_project)
    moved = tmp_path / "a" / "b" / "c"
    shutil.copytree(digits_project, moved)
    shutil.rmtree(digits_project)
    result = verify(moved / LOCK_NAME)
    assert result.code == 0, result.output


# --------------------------------------------------------------------------------------------------------------
# freeze


def test_the_lock_is_canonical_and_records_every_input(digits_project):
    frozen = freeze(digits_project)
    raw = (digits_project / LOCK_NAME).read_bytes()
    text = raw.decode("utf-8")
    lock = json.loads(text)
    assert text == json.dumps(lock, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    assert frozen["sha256"] == hashlib.sha256(raw).hexdigest()
    assert frozen["outcome"] == "written" and frozen["lock"] == str(digits_project / LOCK_NAME)
    assert lock["status"] == "frozen" and lock["format"] == "opalctl-lock/1" and lock["name"] == "digits"
    assert frozen["records"] == len(lock["records"]) and frozen["seeds"] == [1, 2]

    records = lock["records"]
    located = load_lock(digits_project / LOCK_NAME)
    for role, record in records.items():
        if role.startswith("source."):
            assert set(record) == {"base", "path", "bytes", "sha256"} and record["base"] == "opalctl", role
        else:
            assert set(record) == {"path", "bytes", "sha256"}, role
        assert not os.path.isabs(record["path"]) and ".." not in Path(record["path"]).parts, role
        target = located.record_path(record)
        assert target.is_file(), role
        assert record["bytes"] == target.stat().st_size and record["sha256"] == support.sha256_of(target), role
    expected = {"protocol": "digits.yaml", **{f"data.{s}": f"data/digits/{s}.npz"
                                             for s in ("train", "development", "selection", "retention")},
                "parent.seed-1": "parents/digits/seed-1.pt", "parent.seed-2": "parents/digits/seed-2.pt"}
    assert {role: records[role]["path"] for role in expected} == expected
    assert records["source.task"]["path"] == "tasks/digits.py"
    assert located.record_path(records["source.task"]) == PACKAGE / "tasks" / "digits.py"
    sources = {role for role in records if role.startswith("source.opalctl/")}
    assert {f"source.opalctl/{p.relative_to(PACKAGE).as_posix()}" for p in package_files()} == sources
    for role in sources:
        assert records[role]["path"] == role[len("source.opalctl/"):]
        assert located.record_path(records[role]) == PACKAGE / records[role]["path"]
    assert "source.opalctl/cli.py" in sources and "source.opalctl/protocol/freeze.py" in sources


def test_the_lock_holds_the_resolved_protocol_and_its_digest(digits_project):
    freeze(digits_project)
    lock = read_lock(digits_project)
    protocol = lock["protocol"]
    assert lock["protocol_sha256"] == hashlib.sha256(canonical_json(protocol).encode("utf-8")).hexdigest()
    assert protocol["parents"] == {"1": "parents/digits/seed-1.pt", "2": "parents/digits/seed-2.pt"}
    assert protocol["seeds"] == [1, 2]
    assert protocol["budget"] == {"clock": "cpu", "amount": 20.0, "threads": 1, "fractions": [0.25, 0.5, 0.75, 1.0]}
    assert protocol["selection"]["nonincreasing"] == []  # a default, written out
    assert protocol["arms"]["adamw"]["schedule"] == "constant" and protocol["arms"]["adamw"]["agent"] is None
    assert protocol["arms"]["adamw-long"]["budget_multiplier"] == 3.0
    assert protocol["arms"]["adamw"]["optimizer"] == {"name": "AdamW", "lr": 0.001, "weight_decay": 0.01}
    assert protocol["task"] == {"entry": "opalctl.tasks.digits:Digits", "config": {"hidden": 128, "replay_share": 0.25}}


def test_the_lock_records_the_environment(digits_project):
    import torch

    freeze(digits_project)
    environment = read_lock(digits_project)["environment"]
    assert environment["python"] == platform.python_version()
    assert environment["torch"] == torch.__version__
    assert environment["opalctl"] == opalctl.__version__
    assert environment["platform"] == platform.platform()
    assert set(environment["git"]) == {"opalctl", "protocol"}
    for git in environment["git"].values():  # None outside a git repository (the tmp project usually is)
        if git is not None:
            assert len(git["commit"]) == 40 and isinstance(git["dirty"], bool)
    threads = environment["threads"]
    assert threads["budget"] == 1 and isinstance(threads["torch_default"], int)
    assert {"OMP_NUM_THREADS", "MKL_NUM_THREADS"} <= set(threads)


def test_freeze_is_unchanged_when_nothing_changed(digits_project):
    freeze(digits_project)
    lock = digits_project / LOCK_NAME
    before = (lock.read_bytes(), lock.stat().st_mtime_ns)
    again = freeze(digits_project)
    assert again["outcome"] == "unchanged"
    assert (lock.read_bytes(), lock.stat().st_mtime_ns) == before
    human = call_cli("freeze", digits_project / "digits.yaml")
    assert human.code == 0 and "unchanged" in human.stdout


def test_freeze_refuses_to_replace_a_different_lock_without_force(digits_project):
    first = freeze(digits_project)
    lock = digits_project / LOCK_NAME
    before = lock.read_bytes()
    protocol = digits_project / "digits.yaml"
    protocol.write_text(protocol.read_text(encoding="utf-8").replace("seeds: [1, 2]", "seeds: [1]"), encoding="utf-8")

    refused = call_cli("freeze", protocol)
    assert refused.code == 2, refused.output
    assert refused.stderr.startswith("opalctl: error: ") and refused.stderr.count("\n") == 1
    assert str(lock) in refused.stderr and "--force" in refused.stderr
    assert lock.read_bytes() == before

    forced = call_cli("freeze", protocol, "--force", "--json")
    assert forced.code == 0, forced.output
    assert forced.json()["outcome"] == "replaced" and forced.json()["sha256"] != first["sha256"]
    assert read_lock(digits_project)["protocol"]["seeds"] == [1]
    assert "parent.seed-2" not in read_lock(digits_project)["records"]
    assert verify(lock).code == 0


def test_freeze_refuses_a_missing_data_file(digits_project):
    (digits_project / "data/digits/development.npz").unlink()
    result = call_cli("freeze", digits_project / "digits.yaml")
    assert result.code == 2
    assert "missing data.development (data/digits/development.npz)" in result.stderr
    assert not (digits_project / LOCK_NAME).exists()


def test_freeze_of_a_missing_protocol_is_bad_input(tmp_path):
    result = call_cli("freeze", tmp_path / "absent.yaml")
    assert result.code == 2
    assert result.stderr == f"opalctl: error: protocol {tmp_path / 'absent.yaml'} does not exist; check the path " \
                            f"(or write one with `opalctl init`)\n"


# --------------------------------------------------------------------------------------------------------------
# the lock's protocol is validated again where the lock is used, as freeze validates a protocol file


def forge_lock(project: Path, edit) -> Path:
    """A lock edited by hand the way a forger would: ``edit(lock)`` changes its protocol (and may move a file),
    then every data record and the protocol's digest are recomputed, so the lock agrees with itself."""
    from opalctl.files import file_record
    from opalctl.protocol.lock import protocol_digest

    lock = read_lock(project)
    edit(lock)
    for split, relative in lock["protocol"]["data"].items():
        lock["records"][f"data.{split}"] = file_record(project / relative, project)
    lock["protocol_sha256"] = protocol_digest(lock["protocol"])
    return write_lock(project / LOCK_NAME, lock)


def point_selection_at_sealed_data(project: Path):
    def edit(lock: dict) -> None:
        (project / "sealed").mkdir()
        shutil.copy(project / "data/digits/selection.npz", project / "sealed/selection.npz")
        lock["protocol"]["data"]["selection"] = "sealed/selection.npz"
    return edit


def assert_refused_naming_the_lock(result, lock: Path, key: str, text: str):
    assert result.code == 2, result.output
    first, *details = result.stderr.splitlines()
    assert first.startswith(f"opalctl: error: lock {lock}: {key}: "), result.stderr
    assert text in first, first
    assert first.endswith("; `opalctl freeze` never writes such a lock: correct the protocol file and freeze it "
                          "again") and details == []
    assert "Traceback" not in result.output


def test_a_forged_lock_naming_sealed_data_is_refused_by_verify_with_exit_2(digits_project):
    freeze(digits_project)
    lock = forge_lock(digits_project, point_selection_at_sealed_data(digits_project))
    assert load_lock(lock).records["data.selection"]["path"] == "sealed/selection.npz"
    for result in (verify(lock), verify(lock, "--json"), run_cli("verify", lock)):
        assert_refused_naming_the_lock(result, lock, "data.selection", "names sealed data ('sealed')")


def test_a_forged_lock_naming_sealed_data_is_refused_by_run_before_any_work(digits_project, tmp_path):
    freeze(digits_project)
    lock = forge_lock(digits_project, point_selection_at_sealed_data(digits_project))
    runs = tmp_path / "runs"
    result = call_cli("run", lock, "--arm", "adamw", "--seed", "1", "--runs-dir", runs)
    assert_refused_naming_the_lock(result, lock, "data.selection", "names sealed data ('sealed')")
    assert not runs.exists() or not any(runs.rglob("*.json"))


def test_a_forged_lock_whose_parent_is_sealed_is_refused(digits_project):
    freeze(digits_project)

    def edit(lock: dict) -> None:
        (digits_project / "final-test").mkdir()
        shutil.copy(digits_project / "parents/digits/seed-1.pt", digits_project / "final-test/seed-1.pt")
        lock["protocol"]["parents"]["1"] = "final-test/seed-1.pt"
        lock["records"]["parent.seed-1"]["path"] = "final-test/seed-1.pt"

    lock = forge_lock(digits_project, edit)
    assert_refused_naming_the_lock(verify(lock), lock, "parents", "names sealed data ('final-test')")


@pytest.mark.parametrize("key, value, named, text", [
    (("budget", "fractions"), [0.5, 0.25, 1.0], "budget.fractions", "fractions must increase strictly"),
    (("budget", "amount"), "twenty", "budget.amount", "valid number"),
    (("arms", "adamw", "optimizer", "lr"), -1.0, "arms.adamw.optimizer.name", "AdamW refuses these arguments"),
    (("task", "config", "hidden"), 0, "task.config.hidden", "greater than"),
], ids=["fractions", "amount-type", "optimizer-value", "task-config"])
def test_a_lock_whose_protocol_is_edited_to_an_invalid_value_is_refused(digits_project, tmp_path,
                                                                        key, value, named, text):
    freeze(digits_project)

    def edit(lock: dict) -> None:
        node = lock["protocol"]
        for part in key[:-1]:
            node = node[part]
        node[key[-1]] = value

    lock = forge_lock(digits_project, edit)
    assert_refused_naming_the_lock(verify(lock), lock, named, text)
    result = call_cli("run", lock, "--arm", "adamw", "--seed", "1", "--runs-dir", tmp_path / "runs")
    assert_refused_naming_the_lock(result, lock, named, text)


def test_an_edited_invalid_lock_whose_digest_was_not_recomputed_is_a_change_with_exit_3(digits_project):
    """A changed record is named first: the edit shows as a change, which restoring the lock undoes."""
    freeze(digits_project)
    lock = read_lock(digits_project)
    lock["protocol"]["budget"]["fractions"] = [0.5, 0.25, 1.0]
    write_lock(digits_project / LOCK_NAME, lock)
    result = verify(digits_project / LOCK_NAME, "--json")
    assert result.code == 3, result.output
    assert [(p["role"], p["status"]) for p in result.json()["problems"]] == [("lock.protocol", "changed")]


@pytest.mark.parametrize("name", ["../../elsewhere/x", "/tmp/elsewhere", 5, "digits-other"])
def test_a_lock_whose_name_was_edited_by_hand_is_refused_by_every_command_before_any_folder_is_made(
        digits_project, tmp_path, name):
    """The name becomes the runs folder's (runs/NAME-SHA12): one that is no folder name, or is not its protocol's,
    is refused in one sentence naming the lock, by verify and by run, and nothing is written anywhere."""
    freeze(digits_project)
    lock = read_lock(digits_project)
    lock["name"] = name
    path = write_lock(digits_project / LOCK_NAME, lock)
    runs, before = tmp_path / "runs", sorted(p.name for p in tmp_path.parent.iterdir())
    for result in (verify(path),
                   call_cli("run", path, "--arm", "adamw", "--seed", "1", "--runs-dir", runs)):
        assert result.code == 2 and f"lock {path}" in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not runs.exists() and sorted(p.name for p in tmp_path.parent.iterdir()) == before
