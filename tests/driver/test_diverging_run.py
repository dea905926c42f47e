"""A run that diverges is a result (issue 30, group 3): SGD at a learning rate of 1e36 without clipping on the
built-in digits fills the weights with NaN within a few updates. The run finishes (exit 0), its records are strict
JSON (a metric that is not finite is recorded as null), its report says it diverged, ``compare`` flags it, its
chain verifies, and a resume of it, which judges its stages again, works: a diverged model left unchanged by an
evaluation is unchanged by its bytes, though NaN is not equal to itself.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests import support
from tests.support.cli import call_cli

DIVERGING = {"optimizer": {"name": "SGD", "lr": 1.0e36}}
ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}


@pytest.fixture
def diverging(project):
    """20 updates of a diverging SGD arm and an AdamW baseline, no clipping; stages at 10 and 20, a resume
    checkpoint every 5 updates; the pausing task (``FAIL_AT=N`` fails the N-th loss of a process)."""
    entry = project.task_module(support.PAUSE_TASK, "PausingDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": 20, "fractions": [0.5, 1.0]},
                   training={"checkpoint_every": 0.25, "gradient_clip": None},
                   arms={"sgd": DIVERGING, "adamw": ADAMW})
    return project


def _says_diverged(report: dict) -> None:
    assert report["nonfinite_losses"] > 0
    assert report["parameter_change"]["l2"] is None and report["parameter_change"]["nonfinite"]
    assert any("the run diverged" in line for line in report["limitations"])
    assert any("not finite and are recorded as null" in line for line in report["limitations"])
    last = report["stages"][-1]["metrics"]
    assert last["selection.loss"] is None and isinstance(last["selection.correct"], int)


def test_a_diverging_run_finishes_and_its_report_and_compare_say_so(diverging):
    done = call_cli(*diverging.run_args("sgd", 1))
    assert done.code == 0, done.stderr
    run_dir = diverging.run_dir("sgd", 1)
    _says_diverged(support.read(run_dir / "report.json"))
    assert call_cli("verify", run_dir).code == 0
    assert call_cli(*diverging.run_args("adamw", 1)).code == 0
    compared = call_cli("compare", diverging.lock, "--runs-dir", diverging.runs, "--stage", "last", "--json")
    assert compared.code == 0, compared.stderr
    sgd = next(arm for arm in compared.json()["arms"] if arm["arm"] == "sgd")
    assert any(flag.startswith("non-finite results (seed 1:") for flag in sgd["flags"]), sgd["flags"]
    assert "selection.loss" not in sgd["values"] or not sgd["values"]["selection.loss"]
    page = call_cli("report", diverging.lock, "--runs-dir", diverging.runs)
    assert page.code == 0, page.stderr
    assert "the run diverged" in Path(page.stdout.strip().splitlines()[-1]).read_text()
    if importlib.util.find_spec("tensorboard") is not None:
        exported = call_cli("export", diverging.lock, "--runs-dir", diverging.runs, "--tensorboard",
                            diverging.folder / "tb")
        assert exported.code == 0, exported.stderr


def test_a_diverged_run_stopped_after_its_first_stage_resumes_to_the_end(diverging, monkeypatch):
    monkeypatch.setenv("FAIL_AT", "13")
    first = call_cli(*diverging.run_args("sgd", 1))
    assert first.code == 1, first.stderr
    run_dir = diverging.run_dir("sgd", 1)
    assert (run_dir / "stage-01.json").is_file() and not (run_dir / "report.json").exists()
    monkeypatch.delenv("FAIL_AT")
    resumed = call_cli(*diverging.run_args("sgd", 1, "--resume"))
    assert resumed.code == 0, resumed.stderr
    _says_diverged(support.read(run_dir / "report.json"))
    assert call_cli("verify", run_dir).code == 0
