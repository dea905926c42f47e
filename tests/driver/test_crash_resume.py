"""Crash safety: a run killed with SIGKILL anywhere, then resumed with ``--resume`` until it
finishes, ends exactly where an uninterrupted run ends: the same final weights, rows seen, stages, decisions and
selected model, with ``steps.jsonl.gz`` holding one line per update.

The children are real ``python -m opalctl run`` processes. They are killed by themselves, at a chosen point:

- mid-update: the task's ``loss`` kills the process at its N-th call in that process (``KILL_LOSS_AT``);
- during a checkpoint write: ``atomic_write_bytes`` is wrapped so that the K-th write of a named file leaves half
  the bytes in its temporary file and then kills the process.

The evaluator process (driver/evaluator.py) is killed the same way, during an evaluation: the task's
``evaluate``, which runs only there, kills it at its N-th call (``KILL_EVALUATE_AT``); the run then ends with one
sentence and resumes like a killed one. A killed training process leaves no evaluator behind.

The task adds a little noise drawn from torch's global generator to every batch, so a resume that failed to
restore the RNG state would not end with the same weights.
"""

from __future__ import annotations

import copy
import signal
import time
from pathlib import Path

import pytest

from opalctl import checkpoints
from opalctl.driver.records import read_steps
from tests import support
from tests.support.cli import call_cli

UPDATES = 200  # checkpoint_every 0.05: a resume checkpoint every 10 updates; stages at 50, 100, 150 and 200
KILLED = -signal.SIGKILL

CRASH_TASK = '''
import os
import signal

import torch
import torch.nn.functional as F

from opalctl.tasks.digits import Digits

CALLS = {"loss": 0, "evaluate": 0}


def _maybe_die(kind):
    CALLS[kind] += 1
    if os.environ.get(f"KILL_{kind.upper()}_AT") == str(CALLS[kind]):
        os.kill(os.getpid(), signal.SIGKILL)


class CrashDigits(Digits):
    def loss(self, model, batch):
        _maybe_die("loss")
        noisy = batch.inputs + 0.05 * torch.randn_like(batch.inputs)  # the global RNG: a resume must restore it
        return F.cross_entropy(model(noisy), batch.targets), {}

    def evaluate(self, model, rows):
        _maybe_die("evaluate")
        return super().evaluate(model, rows)
'''

TORN_WRITE = '''
import os
import signal
import sys
import tempfile
from pathlib import Path

import opalctl.checkpoints
import opalctl.files

target, kill_at = sys.argv[1], int(sys.argv[2])
original = opalctl.files.atomic_write_bytes
seen = 0


def torn(path, data, *args, **kwargs):
    global seen
    path = Path(path)
    if path.name == target:
        seen += 1
        if seen == kill_at:  # half the bytes reach the temporary file, then the power goes
            fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.write(fd, data[: len(data) // 2])
            os.fsync(fd)
            os.kill(os.getpid(), signal.SIGKILL)
    return original(path, data, *args, **kwargs)


opalctl.files.atomic_write_bytes = torn
opalctl.checkpoints.atomic_write_bytes = torn

from opalctl.cli import main

main(sys.argv[3:])
'''

SELECTION = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 10},
             "improve_any": ["selection.correct"]}


@pytest.fixture(scope="module")
def crash_made(made_project, tmp_path_factory):
    """A protocol on the crash task frozen once for the module, the uninterrupted run of each arm in a runs folder
    of its own (read-only: the references every test compares with), and the updates adamw's run wrote a resume
    checkpoint at."""
    project = made_project("crash")
    entry = project.task_module(CRASH_TASK, "CrashDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": UPDATES},
                   training={"checkpoint_every": 0.05},
                   arms={"adamw": support.ADAMW, "cosine": {**support.ADAMW, "schedule": "cosine"}}, selection=SELECTION)
    reference_runs, written, save = tmp_path_factory.mktemp("crash-reference"), [], checkpoints.save

    def spy(path, model_state, *, kind, meta=None, **kwargs):
        if kind == "resume":
            written.append(meta["update"])
        return save(path, model_state, kind=kind, meta=meta, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(checkpoints, "save", spy)
        project.run("adamw", 1, runs_dir=reference_runs)
    project.run("cosine", 1, runs_dir=reference_runs)
    return project, reference_runs, written


@pytest.fixture
def crash(crash_made, tmp_path):
    """The module's frozen project with this test's own runs folder (``tmp_path / "runs"``), so that its records
    name the same project as the references'; ``reference_runs``: the uninterrupted run of each arm."""
    made, reference_runs, _ = crash_made
    project = copy.copy(made)
    project.runs, project.reference_runs = tmp_path / "runs", reference_runs
    return project


def reference(project, arm, seed=1):
    return project.run_dir(arm, seed, runs=project.reference_runs)


def child(project, arm, *, resume, env=None, torn=None, seed=1):
    """One ``opalctl run`` child; ``torn=(file name, k)`` tears the k-th write of that file."""
    args = project.run_args(arm, seed, *(["--resume"] if resume else []))
    python = None
    if torn is not None:
        python = ["-c", TORN_WRITE, torn[0], str(torn[1])]
    return project.process(args, env=project.env(**(env or {})), python=python)


def evaluators_of(run_dir) -> list[int]:
    """The evaluator processes alive for ``run_dir`` (its command line names the folder)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"opalctl.driver.evaluator" in words and str(run_dir).encode() in words:
            found.append(int(entry.name))
    return found


def assert_no_evaluator_left(run_dir):
    deadline = time.monotonic() + 10
    while evaluators_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)  # it sees its input end once the killed process is gone, and ends
    assert evaluators_of(run_dir) == [], "the evaluator of a killed run ends with it"


def assert_killed(result, run_dir):
    assert result.returncode == KILLED, f"expected SIGKILL, got {result.returncode}: {result.stderr[-2000:]}"
    assert_no_evaluator_left(run_dir)
    assert not (run_dir / "report.json").exists()
    assert (run_dir / "training" / "resume.pt").exists()
    steps = [s["update"] for s in read_steps(run_dir / "training" / "steps.jsonl.gz")]
    assert steps == list(range(1, len(steps) + 1)), "the steps written so far are whole and in order"


def resume_meta(run_dir):
    return checkpoints.load(run_dir / "training" / "resume.pt", require_finite=False)["meta"]


def finish(project, arm, run_dir):
    """``--resume`` to the end, in this process (nothing kills it any more; the kills above were children's)."""
    code, _, err = call_cli(*project.run_args(arm, 1, "--resume"))
    assert code == 0, err[-2000:]
    assert (run_dir / "report.json").exists() and not (run_dir / "training" / "resume.pt").exists()


STEP_KEYS = ("update", "charge", "used", "loss", "rows", "seen", "lrs")
STAGE_KEYS = ("stage", "fraction", "update", "budget_used", "examples", "metrics", "decision", "promoted",
              "incumbent_before", "incumbent_after", "shared_state_with", "loss")


def assert_same_run(crashed, uninterrupted, resumes):
    got, want = support.read(crashed / "report.json"), support.read(uninterrupted / "report.json")
    for key in ("final_model_sha256", "rows_digest", "selected", "promoted_stages", "updates", "examples_seen",
                "anchor_metrics", "nonfinite_losses"):
        assert got[key] == want[key], key
    assert got["budget"]["used"] == want["budget"]["used"] and got["budget"]["overshoot"] == want["budget"]["overshoot"]
    assert [{k: s[k] for k in ("stage", "update", "budget_used", "metrics", "promoted")} for s in got["stages"]] == \
        [{k: s[k] for k in ("stage", "update", "budget_used", "metrics", "promoted")} for s in want["stages"]]
    assert got["resumes"] == resumes and want["resumes"] == 0
    assert any("resumed" in line for line in got["limitations"])

    got_stages, want_stages = support.stage_files(crashed), support.stage_files(uninterrupted)
    assert len(got_stages) == len(want_stages) == 4
    for mine, theirs in zip(got_stages, want_stages, strict=True):
        assert {k: mine[k] for k in STAGE_KEYS} == {k: theirs[k] for k in STAGE_KEYS}
        assert mine["checkpoint"]["model_sha256"] == theirs["checkpoint"]["model_sha256"]
        payload = checkpoints.load(crashed / mine["checkpoint"]["file"])
        assert payload["model_sha256"] == mine["checkpoint"]["model_sha256"]
    assert support.read(crashed / "selected.json") == support.read(uninterrupted / "selected.json")
    assert support.read(crashed / "last.json")["model_sha256"] == support.read(uninterrupted / "last.json")["model_sha256"]

    got_steps = list(read_steps(crashed / "training" / "steps.jsonl.gz"))
    want_steps = list(read_steps(uninterrupted / "training" / "steps.jsonl.gz"))
    assert [s["update"] for s in got_steps] == list(range(1, UPDATES + 1))
    assert [{k: s[k] for k in STEP_KEYS} for s in got_steps] == [{k: s[k] for k in STEP_KEYS} for s in want_steps]


def test_killed_mid_update_twice_then_resumed(crash):
    """Killed inside update 75, resumed and killed inside update 105 (just after stage 2), resumed to the end."""
    expected = reference(crash, "cosine")
    run_dir = crash.run_dir("cosine", 1)

    assert_killed(child(crash, "cosine", resume=False, env={"KILL_LOSS_AT": "75"}), run_dir)
    assert resume_meta(run_dir)["update"] == 70
    assert [p.name for p in sorted(run_dir.glob("stage-*.json"))] == ["stage-01.json"]
    # an interrupted run is not restarted by accident: only --resume continues it
    before = support.snapshot(run_dir)
    code, _, err = call_cli(*crash.run_args("cosine", 1))
    assert code == 2 and "--resume" in err and support.snapshot(run_dir) == before

    # resumed from update 70, the 35th update of this process is update 105
    assert_killed(child(crash, "cosine", resume=True, env={"KILL_LOSS_AT": "35"}), run_dir)
    assert resume_meta(run_dir)["update"] == 100
    assert len(list(run_dir.glob("stage-*.json"))) == 2

    finish(crash, "cosine", run_dir)
    assert_same_run(run_dir, expected, resumes=2)


def test_killed_while_writing_checkpoints_then_resumed(crash):
    """Torn writes: the 4th resume.pt (update 30), then the 18th of the resumed session (update 200), just after
    the last stage was judged."""
    expected = reference(crash, "adamw")
    run_dir = crash.run_dir("adamw", 1)

    assert_killed(child(crash, "adamw", resume=False, torn=("resume.pt", 4)), run_dir)
    # the torn write never replaced the checkpoint: the one before it (update 20) is intact, the half file is aside
    assert resume_meta(run_dir)["update"] == 20
    assert len(list((run_dir / "training").glob(".resume.pt.*.tmp"))) == 1

    assert_killed(child(crash, "adamw", resume=True, torn=("resume.pt", 18)), run_dir)
    assert resume_meta(run_dir)["update"] == UPDATES - 10
    assert (run_dir / "stage-04.json").exists() and not (run_dir / "selected.json").exists()

    finish(crash, "adamw", run_dir)
    assert_same_run(run_dir, expected, resumes=2)


def assert_evaluator_stopped(result, run_dir):
    """The run ended with one sentence naming its evaluator, and left its folder to resume."""
    assert result.returncode == 1, f"expected exit 1, got {result.returncode}: {result.stderr[-2000:]}"
    errors = [line for line in result.stderr.strip().splitlines() if line.startswith("opalctl: error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"opalctl: error: the evaluator of {run_dir} stopped "), errors
    assert result.stderr.strip().splitlines()[-1] == errors[0], "the sentence ends the output"
    assert not (run_dir / "report.json").exists()
    assert_no_evaluator_left(run_dir)


def test_the_evaluator_killed_during_a_stage_evaluation_ends_the_run_in_one_sentence_and_it_resumes(crash):
    """Evaluations 1-3 are the anchor's (three splits), 4-6 stage 1's, 7-9 stage 2's: the evaluator dies inside
    stage 2's."""
    expected = reference(crash, "adamw")
    run_dir = crash.run_dir("adamw", 1)

    result = child(crash, "adamw", resume=False, env={"KILL_EVALUATE_AT": "8"})
    assert_evaluator_stopped(result, run_dir)
    assert "exit status -9" in result.stderr and result.stderr.strip().endswith("resume the run with --resume")
    assert (run_dir / "training" / "stage-02.pt").exists() and not (run_dir / "stage-02.json").exists()
    assert resume_meta(run_dir)["update"] == 90

    finish(crash, "adamw", run_dir)
    assert_same_run(run_dir, expected, resumes=1)


def test_resume_from_a_damaged_checkpoint_is_refused_naming_it(crash):
    run_dir = crash.run_dir("adamw", 1)
    assert_killed(child(crash, "adamw", resume=False, env={"KILL_LOSS_AT": "25"}), run_dir)
    resume = run_dir / "training" / "resume.pt"
    payload = checkpoints.load(resume, require_finite=False)
    name, tensor = max(payload["model"].items(), key=lambda item: item[1].numel())
    data = bytearray(resume.read_bytes())
    offset = data.find(checkpoints.tensor_bytes(tensor))
    assert offset > 0
    data[offset + len(checkpoints.tensor_bytes(tensor)) // 2] ^= 0x10  # one bit inside the largest tensor
    resume.write_bytes(bytes(data))
    before = support.snapshot(crash.runs)

    code, out, err = call_cli(*crash.run_args("adamw", 1, "--resume"))
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opalctl: error: cannot resume: checkpoint ")
    assert str(resume) in lines[0] and name in lines[0]
    assert support.snapshot(crash.runs) == before, "a refused resume changes nothing"


def test_a_run_whose_evaluator_dies_during_the_anchor_evaluation_can_be_started_again(crash):
    run_dir = crash.run_dir("adamw", 1)
    result = child(crash, "adamw", resume=False, env={"KILL_EVALUATE_AT": "2"})
    assert_evaluator_stopped(result, run_dir)
    assert result.stderr.strip().endswith("start the run again")
    assert not (run_dir / "start.json").exists() and not (run_dir / "training" / "resume.pt").exists()

    code, _, err = call_cli(*crash.run_args("adamw", 1, "--resume"))
    assert code == 2 and "start it without --resume" in err
    code, _, err = call_cli(*crash.run_args("adamw", 1))
    assert code == 0, err


def test_resume_checkpoints_are_written_at_every_checkpoint_every_fraction(crash_made):
    _, _, written = crash_made  # by adamw's uninterrupted run
    assert written == list(range(0, UPDATES + 1, UPDATES // 20))
