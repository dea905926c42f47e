"""Fixtures for the grid's tests: one frozen digits protocol per module, on a task that can be held at an update
(``tests.support.grids.GridProject``: the protocol, its gate, and uninterrupted reference runs)."""

from __future__ import annotations

import sys

import pytest

from tests.support.grids import GridProject


@pytest.fixture(scope="module")
def grid_project(digits_init_folder, tmp_path_factory) -> GridProject:
    project = GridProject(digits_init_folder, tmp_path_factory.mktemp("grid") / "project")
    yield project
    if project.task_path in sys.path:
        sys.path.remove(project.task_path)


@pytest.fixture(scope="session")
def grid_tools():
    """tests.support.grids, for the test modules not yet moved to importing it."""
    from tests.support import grids

    return grids
