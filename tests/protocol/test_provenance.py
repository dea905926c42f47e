"""The lock records where a real task came from: every installed distribution's version, and every module of the
task's own package (an edited sibling of the entry module is a changed input, exit 3, named), within limits."""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from opalctl.protocol import provenance
from tests import support
from tests.support.cli import call_cli, run_cli

LOCK_NAME = "digits.lock.json"

ENTRY_MODULE = '''"""The task's entry module: it imports its siblings, as a real task does."""

from opalctl.tasks.digits import Digits

from {package} import helpers
from {package}.parts import layers


class MyDigits(Digits):
    """The digits task, with a hidden size its package's helpers decide."""

    HIDDEN = helpers.HIDDEN + layers.EXTRA
'''


@pytest.fixture
def task_package(monkeypatch, request):
    """``task_package(project, folder, name)``: a package ``name`` in ``folder`` (entry module ``name.task``, a
    sibling ``helpers``, a subpackage ``parts`` with ``layers``, and a script import cannot reach), on sys.path
    for this test; the project's protocol points at ``name.task:MyDigits``."""

    def make(project: Path, folder: Path, name: str) -> Path:
        package = folder / name
        (package / "parts").mkdir(parents=True)
        (package / "__init__.py").write_text('"""A task package."""\n', encoding="utf-8")
        (package / "task.py").write_text(ENTRY_MODULE.format(package=name), encoding="utf-8")
        (package / "helpers.py").write_text("HIDDEN = 128\n", encoding="utf-8")
        (package / "parts" / "__init__.py").write_text("", encoding="utf-8")
        (package / "parts" / "layers.py").write_text("EXTRA = 0\n", encoding="utf-8")
        (package / "not-a-module.py").write_text("print('a script')\n", encoding="utf-8")
        monkeypatch.syspath_prepend(str(folder))
        request.addfinalizer(lambda: [sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == name])
        protocol = project / "digits.yaml"
        protocol.write_text(protocol.read_text(encoding="utf-8").replace(
            "opalctl.tasks.digits:Digits", f"{name}.task:MyDigits"), encoding="utf-8")
        return package

    return make


def freeze(project: Path) -> dict:
    result = call_cli("freeze", project / "digits.yaml", "--json")
    assert result.code == 0, result.output
    return json.loads((project / LOCK_NAME).read_text(encoding="utf-8"))


def test_the_lock_lists_the_version_of_every_installed_distribution(digits_project):
    listed = freeze(digits_project)["environment"]["distributions"]
    assert listed["click"] == importlib.metadata.version("click")
    assert listed["torch"] == importlib.metadata.version("torch")
    for name in ("transformers", "lightning"):  # the frameworks researchers train with, where installed
        try:
            assert listed[name] == importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            assert name not in listed
    assert list(listed) == sorted(listed) and len(listed) >= 20


def test_the_distributions_are_read_once_until_an_install_changes_a_folder_on_the_path(tmp_path, monkeypatch):
    """A freeze reads every distribution's metadata once per process and again after an install: a package
    installed between two freezes of one process (a notebook) is listed by the second."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    reads = []
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions", lambda *a, **k: reads.append(1) or real(*a, **k))
    first = provenance.distributions()
    assert provenance.distributions() == first and len(reads) == 1  # nothing changed: not read again
    info = folder / "opalctl_probe_pkg-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: opalctl_probe_pkg\nVersion: 1.2.3\n")
    second = provenance.distributions()
    assert len(reads) == 2 and second["opalctl-probe-pkg"] == "1.2.3"
    second["torch"] = "edited by a caller"
    assert provenance.distributions()["torch"] == first["torch"]  # each caller gets its own copy


def test_every_module_of_a_task_package_outside_the_project_is_recorded_by_module_name(
        digits_project, tmp_path, task_package):
    modules = tmp_path / "modules"
    package = task_package(digits_project, modules, "mypkg_outside")
    records = freeze(digits_project)["records"]
    assert records["source.task"]["module"] == "mypkg_outside.task"
    recorded = {role: record for role, record in records.items() if role.startswith(provenance.PACKAGE_ROLE)}
    assert sorted(recorded) == [provenance.PACKAGE_ROLE + name for name in (
        "mypkg_outside", "mypkg_outside.helpers", "mypkg_outside.parts", "mypkg_outside.parts.layers")]
    assert recorded[provenance.PACKAGE_ROLE + "mypkg_outside.helpers"] == {
        "base": "module", "module": "mypkg_outside.helpers", "path": "helpers.py",
        "bytes": (package / "helpers.py").stat().st_size, "sha256": support.sha256_of(package / "helpers.py")}


def test_an_edited_sibling_module_of_the_task_is_named_by_verify_with_exit_3(
        digits_project, tmp_path, task_package):
    package = task_package(digits_project, tmp_path / "modules", "mypkg_sibling")
    freeze(digits_project)
    lock = digits_project / LOCK_NAME
    assert call_cli("verify", lock).code == 0
    layers = package / "parts" / "layers.py"
    layers.write_text("EXTRA = 1\n", encoding="utf-8")  # same size, other bytes: what an edit usually is
    for result in (call_cli("verify", lock, "--json"),
                   run_cli("verify", lock, "--json", env={"PYTHONPATH": str(tmp_path / "modules")})):
        assert result.code == 3, result.output
        assert [(p["role"], p["path"], p["status"]) for p in json.loads(result.stdout)["problems"]] == [
            (provenance.PACKAGE_ROLE + "mypkg_sibling.parts.layers", str(layers.resolve()), "changed")]


def test_a_task_package_inside_the_project_is_recorded_relative_to_the_lock(
        digits_project, task_package):
    package = task_package(digits_project, digits_project / "src", "mypkg_inside")
    records = freeze(digits_project)["records"]
    assert records[provenance.PACKAGE_ROLE + "mypkg_inside.helpers"]["path"] == "src/mypkg_inside/helpers.py"
    (package / "helpers.py").write_text("HIDDEN = 127\n", encoding="utf-8")
    result = run_cli("verify", digits_project / LOCK_NAME)  # read beside the lock: no PYTHONPATH needed
    assert result.code == 3, result.output
    assert [line.split()[1:] for line in result.stdout.splitlines() if line.startswith(provenance.PACKAGE_ROLE)] == [
        ["src/mypkg_inside/helpers.py", "changed"]]


def test_a_task_package_over_the_file_limit_is_refused_naming_the_package(
        digits_project, tmp_path, task_package):
    package = task_package(digits_project, tmp_path / "modules", "mypkg_huge")
    for index in range(provenance.MAX_PACKAGE_FILES):
        (package / f"generated_{index}.py").write_bytes(b"")
    result = call_cli("freeze", digits_project / "digits.yaml")
    assert result.code == 2, result.output
    assert "task.entry's package mypkg_huge" in result.output and "a package of its own" in result.output
    assert "Traceback" not in result.output and not (digits_project / LOCK_NAME).exists()


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_module_added_to_the_task_package_after_the_freeze_is_listed_as_added(
        digits_project, tmp_path, task_package, where):
    from opalctl.protocol.lock import read_lock

    name = f"mypkg_added_{where}"
    folder = tmp_path / "modules" if where == "outside" else digits_project / "src"
    package = task_package(digits_project, folder, name)
    freeze(digits_project)
    lock = read_lock(digits_project / LOCK_NAME)
    assert provenance.added_sources(lock) == []
    (package / "parts" / "attention.py").write_text("HEADS = 4\n", encoding="utf-8")
    assert provenance.added_sources(lock) == [{"role": provenance.PACKAGE_ROLE + f"{name}.parts.attention",
                                               "path": str((package / "parts" / "attention.py").resolve()),
                                               "status": "added"}]


def test_nothing_is_added_for_a_built_in_task(digits_project):
    from opalctl.protocol.lock import read_lock

    freeze(digits_project)
    assert provenance.added_sources(read_lock(digits_project / LOCK_NAME)) == []


def test_verify_names_a_module_added_to_the_task_package_with_exit_3(
        digits_project, tmp_path, task_package):
    package = task_package(digits_project, tmp_path / "modules", "mypkg_verify_added")
    freeze(digits_project)
    lock = digits_project / LOCK_NAME
    assert call_cli("verify", lock).code == 0
    (package / "extra.py").write_text("X = 1\n", encoding="utf-8")
    result = call_cli("verify", lock, "--json")
    assert result.code == 3, result.output
    assert [(p["role"], p["status"]) for p in json.loads(result.stdout)["problems"]] == [
        (provenance.PACKAGE_ROLE + "mypkg_verify_added.extra", "added")]
