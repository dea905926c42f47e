"""The evaluator process (driver/evaluator.py): results come from a process the training code never touched.

Every run here that patches torch or records what it opens is a real ``python -m opalctl run`` child, so that
nothing it does reaches this test process, whose own clean evaluation of the stage checkpoints is the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opalctl import checkpoints
from tests import support
from tests.support.cli import call_cli
from tests.support.runs import killed_at

UPDATES = 40  # stages at 10, 20, 30 and 40; a resume checkpoint every 2 updates

PATCHING_TASK = '''
import os

import torch
import torch.nn.functional as F

from opalctl.tasks.digits import Digits


def _patch_torch():
    """What a hostile program would do in the training process: every count is full marks, every loss is 0."""
    if getattr(torch.Tensor, "_bribed", False):
        return
    original_forward = torch.nn.Linear.forward
    torch.Tensor.sum = lambda self, *args, **kwargs: torch.tensor(self.numel())
    torch.nn.Linear.forward = lambda self, x: (original_forward(self, x) if torch.is_grad_enabled()
                                               else torch.zeros(x.shape[0], self.out_features))
    torch.Tensor._bribed = True
    open(os.environ["PATCHED_MARK"], "w").write("patched")


class PatchingDigits(Digits):
    def loss(self, model, batch):
        _patch_torch()
        return F.cross_entropy(model(batch.inputs), batch.targets), {}
'''

AUDITED_RUN = '''
import atexit
import json
import sys

import opalctl.protocol.recheck

opened = []
checked = []  # the lock's re-hash of every file is done: from here on the run works
require_unchanged = opalctl.protocol.recheck.require_unchanged


def after_the_check(lock):
    require_unchanged(lock)
    checked.append(True)


def hook(event, args):
    if event == "open" and checked and isinstance(args[0], (str, bytes)):
        opened.append(args[0] if isinstance(args[0], str) else args[0].decode(errors="replace"))


def write():
    with open(sys.argv[1], "w") as handle:
        json.dump(opened, handle)


atexit.register(write)
sys.addaudithook(hook)
opalctl.protocol.recheck.require_unchanged = after_the_check

from opalctl.cli import main

main(sys.argv[2:])
'''


def clean_metrics(project, report, run_dir):
    """Each stage checkpoint evaluated here, in a process no task or program patched."""
    from opalctl.driver.build import build_arm
    from opalctl.driver.judge import Judge, SavedStage
    from opalctl.protocol.lock import read_lock

    lock = read_lock(project.lock)
    protocol = lock.protocol()
    parts = build_arm(protocol, protocol.arms["adamw"], 1, lock.parent_path(1),
                      {split: lock.data_path(split) for split in protocol.data})
    judge = Judge.build(parts.task, parts.splits, lock.parent_path(1), protocol.arms["adamw"], 1, "cpu", protocol)
    out = []
    for stage in report["stages"]:
        checkpoint = stage["checkpoint"]
        out.append(judge.evaluate(SavedStage(index=stage["stage"] - 1, root=run_dir, name=checkpoint["file"],
                                             sha256=checkpoint["sha256"], model_sha256=checkpoint["model_sha256"],
                                             bytes=checkpoint["bytes"])))
    return out


@pytest.fixture(scope="module")
def patched_and_audited(made_project, tmp_path_factory):
    """One ``opalctl run`` child whose task patches torch in its training process, run under an audit hook that
    records every file the process opens once the lock's check is done: (its project, the file of what it opened,
    the patch's mark, the finished child)."""
    project, folder = made_project("patched"), tmp_path_factory.mktemp("patched-marks")
    entry = project.task_module(PATCHING_TASK, "PatchingDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": 8}, arms={"adamw": support.ADAMW})
    mark, opened_file = folder / "patched", folder / "opened.json"
    result = project.process(project.run_args("adamw", 1), env=project.env(PATCHED_MARK=str(mark)),
                             python=["-c", AUDITED_RUN, str(opened_file)])
    return project, opened_file, mark, result


def test_a_task_that_patches_torch_in_the_training_process_still_gets_the_clean_metrics_of_its_checkpoints(
        patched_and_audited):
    project, _, mark, result = patched_and_audited
    assert result.returncode == 0, result.stderr[-2000:]
    assert mark.read_text() == "patched", "the training process was patched"
    run_dir = project.run_dir("adamw", 1)
    report = support.read(run_dir / "report.json")
    metrics = [stage["metrics"] for stage in report["stages"]]
    assert metrics == clean_metrics(project, report, run_dir)
    assert all(m["selection.correct"] < m["selection.total"] and m["selection.loss"] > 0 for m in metrics)
    assert [support.read(path)["metrics"] for path in sorted(run_dir.glob("stage-*.json"))] == metrics


def test_the_training_process_never_opens_the_evaluation_split_files(patched_and_audited):
    """After the lock's check (which hashes every file before anything runs), the training process opens the
    train split and no other."""
    from opalctl.protocol.lock import read_lock

    project, opened_file, _, result = patched_and_audited
    assert result.returncode == 0, result.stderr[-2000:]
    opened = {Path(path).resolve() for path in json.loads(opened_file.read_text())}
    lock = read_lock(project.lock)
    splits = {split: lock.data_path(split).resolve() for split in lock.protocol().data}
    assert splits["train"] in opened, "the audit sees the files the run opens"
    assert [split for split, path in splits.items() if path in opened] == ["train"]
    assert support.read(project.run_dir("adamw", 1) / "report.json")["anchor_metrics"]["selection.total"] > 0


@pytest.fixture(scope="module")
def killed(made_project):
    """A run killed inside update 15, built once for the module: its resume checkpoint (update 14) carries
    stage 1. Each test resumes its own copy (``killed.copy(tmp_path)``)."""
    project = made_project("killed")
    entry = project.task_module(support.KILLABLE_TASK, "KillableDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": UPDATES}, training={"checkpoint_every": 0.05},
                   arms={"adamw": support.ADAMW}, selection={**support.LENIENT, "floors": {"retention.correct": 1000}})
    run_dir = killed_at(project, "adamw", 1, 15)
    assert (run_dir / "stage-01.json").exists() and (run_dir / "training" / "resume.pt").exists()
    return project


def killed_after_stage_one(killed, tmp_path, monkeypatch):
    """This test's copy of the killed run: (its project, its run folder)."""
    project = killed.copy(tmp_path, monkeypatch)
    return project, project.run_dir("adamw", 1)


def resume_claims(run_dir: Path, stages: int) -> None:
    """Rewrite the resume checkpoint to say it passed ``stages`` stages (the training process's claim)."""
    resume = run_dir / "training" / "resume.pt"
    payload = checkpoints.load(resume, require_finite=False)
    payload["extra"]["stages"] = stages
    checkpoints.save(resume, payload["model"], kind="resume", extra=payload["extra"], meta=payload["meta"])


def forge_stage_file(run_dir: Path, change, canonical: bool) -> None:
    from opalctl.files import canonical_json

    path = run_dir / "stage-01.json"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(canonical_json(record) if canonical else json.dumps(record))


def better(record):
    record["metrics"]["selection.correct"] += 7
    record["promoted"], record["incumbent_after"] = True, 1


@pytest.mark.parametrize("canonical, said", [(True, "does not match a new evaluation of"),
                                             (False, "is not as opalctl wrote it")])
def test_a_forged_stage_record_is_refused_on_resume_naming_the_file(killed, tmp_path, monkeypatch, canonical, said):
    project, run_dir = killed_after_stage_one(killed, tmp_path, monkeypatch)
    forge_stage_file(run_dir, better, canonical)
    before = support.snapshot(run_dir)
    code, out, err = call_cli(*project.run_args("adamw", 1, "--resume"))
    lines = err.strip().splitlines()
    assert code == 3 and len(lines) == 1, err  # an edited record: it no longer matches (exit 3)
    assert said in lines[0] and str(run_dir / "stage-01.json") in lines[0]
    assert ("metrics" in lines[0]) == canonical and not (run_dir / "report.json").exists()
    assert support.snapshot(run_dir) == before, "a refused resume changes nothing"


def test_a_resume_checkpoint_that_claims_other_stages_than_the_evaluators_records_is_refused(killed, tmp_path,
                                                                                           monkeypatch):
    project, run_dir = killed_after_stage_one(killed, tmp_path, monkeypatch)
    resume_claims(run_dir, 0)  # stage 1 forgotten: the next stage the training process sends is stage 2
    code, _, err = call_cli(*project.run_args("adamw", 1, "--resume"))
    assert code == 1 and "sent stage(s) [2] where stage 1 was next" in err
    resume_claims(run_dir, 3)  # stages never judged: the evaluator has no record of them
    code, _, err = call_cli(*project.run_args("adamw", 1, "--resume"))
    assert code == 1 and f"{run_dir / 'stage-02.json'} is missing" in err, err
    assert not (run_dir / "report.json").exists()


def test_an_honest_resume_is_judged_again_and_ends_with_the_records_of_an_uninterrupted_run(killed, tmp_path,
                                                                                          monkeypatch):
    project, run_dir = killed_after_stage_one(killed, tmp_path, monkeypatch)
    code, _, err = call_cli(*project.run_args("adamw", 1, "--resume"))
    assert code == 0, err[-2000:]
    reference = project.run("adamw", 1, runs_dir=tmp_path / "reference")
    got = support.read(run_dir / "report.json")
    for key in ("final_model_sha256", "rows_digest", "selected", "promoted_stages", "anchor_metrics"):
        assert got[key] == reference[key], key
    assert [(s["metrics"], s["decision"]) for s in got["stages"]] == \
        [(s["metrics"], s["decision"]) for s in reference["stages"]]


def test_the_report_and_start_record_say_which_confinement_the_training_process_had(finished_runs):
    run_dir = finished_runs["base"] / "adamw" / "seed-1"  # the session's finished runs (read-only)
    report, start = support.read(run_dir / "report.json"), support.read(run_dir / "start.json")
    # a plain arm runs no agent code: it is never confined
    assert report["confinement"] is None and "confinement" in start and start["confinement"] is None
