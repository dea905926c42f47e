"""Fixtures for the driver's tests: a built-in digits project, frozen per test with the changes a test needs.

The digits project (data files and one parent per seed) is made once per test session (tests/conftest.py); each
test gets its own copy in ``tmp_path`` (``tests.support.runs.Project``: rewrite the protocol, freeze it, run arms).
Runs go to ``tmp_path / "runs"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.runs import ADAMW, PAUSE_TASK, Project


@pytest.fixture(scope="session")
def digits_template(digits_init_folder) -> Path:
    """An initialised digits project with parents for seeds 1 and 2 (the session's ``digits_init_folder``,
    tests/conftest.py); read-only (tests copy it)."""
    return Path(digits_init_folder)


@pytest.fixture
def project(digits_template, tmp_path, monkeypatch) -> Project:
    return Project(digits_template, tmp_path / "project", monkeypatch)


@pytest.fixture
def pausing(project) -> Project:
    """The project frozen on ``PAUSE_TASK``: 20 updates of adamw, stages and resume checkpoints every 5."""
    entry = project.task_module(PAUSE_TASK, "PausingDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": 20, "fractions": [0.25, 0.5, 0.75, 1.0]},
                   training={"checkpoint_every": 0.25}, arms={"adamw": ADAMW})
    return project


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
