"""Fixtures for the driver's tests: a built-in digits project, frozen per test with the changes a test needs.

The digits project (data files and one parent per seed) is made once per test session (tests/conftest.py); each
test gets its own copy in ``tmp_path`` (``tests.support.runs.Project``: rewrite the protocol, freeze it, run arms).
Runs go to ``tmp_path / "runs"``. The pausing project (``PAUSE_TASK``) is frozen once per session with its
uninterrupted run and a run its task failed at update 13 (``pausing_made``): tests copy the project
(``pausing``), compare with that run (``pausing_reference``) or resume a copy of the failed one
(``pausing_failed``) rather than run them again.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.support.files import read
from tests.support.runs import ADAMW, PAUSE_TASK, Project


@pytest.fixture(scope="session")
def digits_template(digits_init_folder) -> Path:
    """An initialised digits project with parents for seeds 1 and 2 (the session's ``digits_init_folder``,
    tests/conftest.py); read-only (tests copy it)."""
    return Path(digits_init_folder)


@pytest.fixture
def project(digits_template, tmp_path, monkeypatch) -> Project:
    return Project(digits_template, tmp_path / "project", monkeypatch)


PAUSING_FAILED_AT = 13  # the loss call the shared failed run of ``pausing_failed`` stopped at (``FAIL_AT``)


def _made_pausing(template: Path, folder: Path) -> None:
    """``folder / "project"`` frozen on ``PAUSE_TASK``; in ``folder / "reference"`` its run of adamw on seed 1 to
    the end, and in ``folder / "failed"`` the same run failed by its task at loss call ``PAUSING_FAILED_AT`` (its
    resume checkpoint at update 10, its steps records at 12 lines)."""
    from opalctl.tasks.calls import TaskFailed

    with pytest.MonkeyPatch.context() as monkeypatch:
        project = Project(template, folder / "project", monkeypatch)
        entry = project.task_module(PAUSE_TASK, "PausingDigits")
        project.freeze(entry=entry, budget={"clock": "updates", "amount": 20, "fractions": [0.25, 0.5, 0.75, 1.0]},
                       training={"checkpoint_every": 0.25}, arms={"adamw": ADAMW})
        project.run("adamw", 1, runs_dir=folder / "reference")
        monkeypatch.setenv("FAIL_AT", str(PAUSING_FAILED_AT))
        with pytest.raises(TaskFailed, match="failed in loss: RuntimeError: the test stops this run here"):
            project.run("adamw", 1, runs_dir=folder / "failed")


@pytest.fixture(scope="session")
def pausing_made(made_once, digits_template) -> Path:
    """The folder ``_made_pausing`` fills, once per test session (read-only: ``pausing`` hands each test a copy)."""
    return made_once("opalctl-pausing", lambda folder: _made_pausing(digits_template, folder))


@pytest.fixture
def pausing(pausing_made, tmp_path, monkeypatch) -> Project:
    """A copy of the project frozen on ``PAUSE_TASK`` (20 updates of adamw, stages and resume checkpoints every 5),
    with no runs: the lock is frozen once per session, so every test's runs are of the same lock."""
    return Project.frozen_at(pausing_made / "project", tmp_path, monkeypatch)


@pytest.fixture
def pausing_reference(pausing, pausing_made) -> tuple[Path, dict]:
    """The run folder and report of ``pausing``'s lock run to its end uninterrupted (shared by the session:
    read-only), the weights a stopped and resumed run must end with."""
    run_dir = pausing.run_dir("adamw", 1, runs=pausing_made / "reference")
    return run_dir, read(run_dir / "report.json")


@pytest.fixture
def pausing_failed(pausing, pausing_made) -> Project:
    """``pausing`` with its runs folder holding a copy of the session's run failed at loss call
    ``PAUSING_FAILED_AT`` (the task raised there; the resume checkpoint is at update 10)."""
    shutil.copytree(pausing_made / "failed", pausing.runs, symlinks=True)
    return pausing


@pytest.fixture(scope="module")
def made_project(digits_template, tmp_path_factory):
    """``made_project(name)``: a ``Project`` in a folder of its own for this module, for runs built once and copied
    by each test (``Project.copy``); its task folders leave ``sys.path`` at the module's end."""
    made: list[Project] = []

    def make(name: str) -> Project:
        made.append(Project(digits_template, tmp_path_factory.mktemp(name) / "project"))
        return made[-1]

    yield make
    for project in made:
        for path in project.task_paths:
            if path in sys.path:
                sys.path.remove(path)
