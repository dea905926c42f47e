"""CI never passes by skipping a test that needs a system component (the rule in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests import support


def _run_pytest(folder, require: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "OPALCTL_REQUIRE_SYSTEM"}
    if require:
        env["OPALCTL_REQUIRE_SYSTEM"] = "1"
    # the copied conftest imports tests.support, which lives in the repository, not beside the copy
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(support.REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           str(folder)], cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def _project(tmp_path):
    folder = tmp_path / "suite"
    folder.mkdir()
    shutil.copy(support.REPO / "tests" / "conftest.py", folder / "conftest.py")
    (folder / "test_probe.py").write_text(
        "import pytest\n\n"
        "def test_needs_a_component():\n"
        f"    pytest.skip({support.SYSTEM_SKIP + ' frobnicator is not installed'!r})\n\n"
        "def test_skips_for_another_reason():\n"
        "    pytest.skip('needs CUDA')\n")
    return folder


def test_a_system_component_skip_is_a_skip_on_a_laptop(tmp_path):
    result = _run_pytest(_project(tmp_path), require=False)
    assert result.returncode == 0, result.stdout
    assert "2 skipped" in result.stdout


def test_a_system_component_skip_fails_when_ci_requires_the_components(tmp_path):
    result = _run_pytest(_project(tmp_path), require=True)
    assert result.returncode == 1, result.stdout
    assert "1 failed" in result.stdout and "1 skipped" in result.stdout
