"""The user's task is the user's (issue 30, group 4): every way a task can fail is one sentence naming the task, the
method and the exception, exit 1, never "internal error" or "a bug in opalctl"; what it returns is checked (the
loss a scalar with a gradient, the metrics numbers of their kind, the sampler's state plain data, checked at
update 0); what it prints never reaches stdout. The task is tests/tasks/failing_task.py, failing in the way
``TASK_FAIL`` names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import support
from tests.support.cli import call_cli

TASK_SOURCE = (Path(__file__).resolve().parents[1] / "tasks" / "failing_task.py").read_text()
ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}


def frozen(project):
    """8 updates of adamw on the failing task: stages at 4 and 8, resume checkpoints at 0, 4 and 8."""
    project.entry = project.task_module(TASK_SOURCE, "FailingDigits")
    project.freeze(entry=project.entry, budget={"clock": "updates", "amount": 8, "fractions": [0.5, 1.0]},
                   training={"checkpoint_every": 0.5}, arms={"adamw": ADAMW})
    return project


@pytest.fixture
def failing(project):
    return frozen(project)


@pytest.fixture(scope="module")
def failed_mid_run(made_project):
    """A run whose loss failed at its 6th call (after the checkpoint at update 4), built once: (the project, what it
    said); each test resumes its own ``Project.copy``."""
    project = frozen(made_project("failed-mid-run"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TASK_FAIL_AT", "6")
        said = _fails(project, monkeypatch, "loss")
    return project, said


@pytest.fixture(scope="module")
def printing_numpy_run(made_project):
    """A whole run, as a child with ``--json``, of the task that prints from every method and returns its metrics
    as numpy numbers: (the project, the finished child)."""
    project = frozen(made_project("printing-numpy"))
    done = project.process(project.run_args("adamw", 1, "--json"), env=project.env(TASK_FAIL="print,metric_numpy"))
    return project, done


def _fails(project, monkeypatch, way: str, *more: str) -> str:
    """Run with the task failing in ``way``: exit 1 and one sentence; returns it."""
    monkeypatch.setenv("TASK_FAIL", way)
    code, out, err = call_cli(*project.run_args("adamw", 1, *more))
    assert code == 1, err
    assert out == ""
    lines = [line for line in err.strip().splitlines() if not line.startswith("stage ")]  # progress lines
    assert len(lines) == 1 and lines[0].startswith("opalctl: error: task "), err
    assert "internal error" not in err and "bug in opalctl" not in err and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(("way", "method", "exception"), [
    ("load", "load", "OSError: the test's load fails"),
    ("build", "build", "RuntimeError: the test's build fails"),
    ("sampler", "sampler", "ZeroDivisionError: the test's sampler fails"),
    ("next_batch", "sampler's next_batch", "RuntimeError: the test's next_batch fails"),
    ("state_dict", "sampler's state_dict", "KeyError: \"the test's state_dict fails\""),
    # loss: test_a_loss_that_fails_mid_run_ends_resumable_and_resumes_once_the_cause_has_passed
    ("evaluate", "evaluate", "IndexError: the test's evaluate fails"),
])
def test_an_exception_in_a_task_method_is_one_sentence_naming_the_task_and_the_method(
        failing, monkeypatch, way, method, exception):
    said = _fails(failing, monkeypatch, way)
    assert f"task {failing.entry} failed in {method}: {exception}; fix the task" in said


def test_a_loss_that_fails_mid_run_ends_resumable_and_resumes_once_the_cause_has_passed(failed_mid_run, tmp_path,
                                                                                        monkeypatch):
    made, said = failed_mid_run
    assert f"task {made.entry} failed in loss: RuntimeError: the test's loss fails; fix the task" in said
    assert said.endswith("--resume` continues the run")
    failing = made.copy(tmp_path, monkeypatch)
    code, _, err = call_cli(*failing.run_args("adamw", 1, "--resume"))
    assert code == 0, err
    assert support.read(failing.run_dir("adamw", 1) / "report.json")["updates"] == 8


def test_a_failing_load_state_dict_at_a_resume_is_one_sentence(failed_mid_run, tmp_path, monkeypatch):
    failing = failed_mid_run[0].copy(tmp_path, monkeypatch)
    said = _fails(failing, monkeypatch, "load_state_dict", "--resume")
    assert "failed in sampler's load_state_dict: ValueError: the test's load_state_dict fails" in said


def test_a_loss_of_one_value_per_row_is_refused_as_not_a_scalar(failing, monkeypatch):
    said = _fails(failing, monkeypatch, "loss_vector")
    assert f"task {failing.entry}'s loss returned a loss of shape (64,), not a scalar" in said


def test_a_loss_without_a_gradient_is_refused(failing, monkeypatch):
    said = _fails(failing, monkeypatch, "loss_no_grad")
    assert "'s loss returned a loss that requires no gradient" in said


def test_a_numpy_integer_in_the_sampler_state_is_refused_at_update_0_naming_state_dict(failing, monkeypatch):
    said = _fails(failing, monkeypatch, "state_numpy")
    assert (f"task {failing.entry}'s sampler's state_dict returned a numpy.int64 at state['streams'][0]"
            f"['position'], which a resume checkpoint cannot hold") in said
    assert not (failing.run_dir("adamw", 1) / "training" / "resume.pt").exists()


# One kind through a run (a count: the lock's declared kinds reach the evaluator's check); every other way a metric
# is not a number of its kind goes the same way and is tests/tasks/test_task_calls.py's, without a run.
def test_a_metric_that_is_not_a_number_of_its_kind_is_refused_naming_it(failing, monkeypatch):
    said = _fails(failing, monkeypatch, "metric_nan_count")
    assert f"task {failing.entry}'s evaluate returned nan, not a whole number for metric 'total' (a count metric)" \
        in said


def test_numpy_metrics_are_converted_and_the_run_finishes(printing_numpy_run):
    failing, done = printing_numpy_run
    assert done.returncode == 0, done.stderr
    metrics = support.read(failing.run_dir("adamw", 1) / "stage-02.json")["metrics"]
    assert type(metrics["selection.correct"]) is int and type(metrics["selection.total"]) is int
    assert type(metrics["selection.loss"]) is float


def test_a_task_that_prints_leaves_run_json_one_document(printing_numpy_run):
    _, done = printing_numpy_run
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["updates"] == 8
    assert "the failing task prints from loss" in done.stderr
