"""The parts a formal run is made of: the ledger, the judge, the build step shared with the pilot, and the plain
twins of the fast paths (the steps helper process against the in-process writer, the hand-formatted steps line
against ``json.dumps``)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opalctl import checkpoints
from opalctl.driver.evaluation import _same_rng, evaluate_all, rng_state
from opalctl.driver.ledger import Ledger
from opalctl.driver.records import StepsWriter, locate, read_steps
from opalctl.formats import StageRecord, step_line, step_line_plain
from tests import support
from tests.support.cli import call_cli

NOISY_TASK = '''
import torch
import torch.nn.functional as F

from opalctl.tasks.digits import Digits


class NoisyDigits(Digits):
    def loss(self, model, batch):
        noisy = batch.inputs + 0.05 * torch.randn_like(batch.inputs)  # torch's global generator
        return F.cross_entropy(model(noisy), batch.targets), {}
'''


# --------------------------------------------------------------------------------------------------------------
# the plain twins


def write_rows(writer: StepsWriter, rows) -> list:
    """Send ``rows`` in two flushes with a sync between them; the writer's figures after each step."""
    seen = []
    for index, row in enumerate(rows):
        writer.add(*row)
        if index == len(rows) // 2:
            writer.begin_sync()
            seen.append((writer.finish_sync(), writer.seen))
    sums = writer.take_sums()
    writer.close()
    return seen + [(sums, writer.seen, writer.lines, writer.last_loss)]


def writer_of(path: Path, cpu_charges: bool, in_process: bool, started_first: bool, **where) -> StepsWriter:
    """A writer opened at once, or started first and opened afterwards, as a confined run does."""
    if not started_first:
        return StepsWriter(path, cpu_charges=cpu_charges, in_process=in_process, **where)
    writer = StepsWriter.started(path, cpu_charges=cpu_charges, in_process=in_process)
    writer.open(**where)
    return writer


@pytest.mark.parametrize("started_first", [False, True], ids=["opened-at-once", "started-first"])
@pytest.mark.parametrize("cpu_charges", [False, True])
def test_the_steps_helper_and_the_in_process_writer_write_the_same_bytes_digests_and_sums(tmp_path, cpu_charges,
                                                                                          started_first):
    weight = torch.tensor(0.5)
    rows = [(update, 0.25 * update, 0.5 * update, 0.001 * update,
             float("nan") if update == 3 else (weight * update).detach() if update % 2 else 0.1 * update,
             np.arange(update, update + 5, dtype=np.int64)) for update in range(1, 12)]
    fast, plain = tmp_path / "fast.jsonl.gz", tmp_path / "plain.jsonl.gz"
    fast_figures = write_rows(writer_of(fast, cpu_charges, False, started_first), rows)
    plain_figures = write_rows(writer_of(plain, cpu_charges, True, started_first), rows)
    assert fast.read_bytes() == plain.read_bytes()
    assert repr(fast_figures) == repr(plain_figures)  # repr: the nan loss compares equal to itself
    # and the twin resumes like the helper: the file cut back to a line count, the digest continued
    offset, seen, _ = locate(plain, 6)
    resumed = writer_of(plain, cpu_charges, True, started_first, offset=offset, seen=seen, lines=6)
    for row in rows[6:]:
        resumed.add(*row)
    resumed.close()
    assert plain.read_bytes()[:offset] == fast.read_bytes()[:offset]
    assert [line["seen"] for line in read_steps(plain)] == [line["seen"] for line in read_steps(fast)]


def test_the_in_process_writer_refuses_a_file_it_cannot_open(tmp_path):
    from opalctl.errors import OpalctlError

    with pytest.raises(OpalctlError, match=r"steps records .*missing.* cannot be written: No such file"):
        StepsWriter(tmp_path / "missing" / "steps.jsonl.gz", in_process=True)


numbers = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(update=st.integers(min_value=0, max_value=2 ** 62), charge=numbers, used=numbers, wall=numbers,
       loss=st.floats(allow_nan=True, allow_infinity=True), cpu_charges=st.booleans())
def test_the_hand_formatted_steps_line_is_the_json_dumps_line(update, charge, used, wall, loss, cpu_charges):
    rows, seen = "0123456789abcdef", "0" * 32
    assert step_line(update, charge, used, wall, loss, rows, seen, cpu_charges) == \
        step_line_plain(update, charge, used, wall, loss, rows, seen, cpu_charges)


# --------------------------------------------------------------------------------------------------------------
# the ledger


def busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_work_outside_the_budget_is_timed_and_its_cpu_time_is_never_training(monkeypatch):
    clock = {"cpu": 0.0, "wall": 0.0}
    monkeypatch.setattr(time, "process_time", lambda: clock["cpu"])
    monkeypatch.setattr(time, "perf_counter", lambda: clock["wall"])
    ledger = Ledger(cpu_charges=False)
    with ledger.outside("checkpoint_wall"):  # before the loop: nothing is training's yet
        clock["cpu"] += 1.0
        clock["wall"] += 2.0
    ledger.loop_begins()
    clock["cpu"] += 3.0  # training
    with ledger.outside():  # a stage: nested spans fold once, at the outermost
        clock["cpu"] += 5.0
        with ledger.outside("eval_wall"):
            clock["cpu"] += 7.0
            clock["wall"] += 0.5
        clock["cpu"] += 11.0
    clock["cpu"] += 13.0  # training
    with ledger.outside("agent_wait_wall"):
        clock["wall"] += 0.25
    assert (ledger.train_cpu, ledger.checkpoint_wall, ledger.eval_wall, ledger.agent_wait_wall) == \
        (16.0, 2.0, 0.5, 0.25)
    with pytest.raises(ValueError, match="not one of the ledger's seconds"):
        with ledger.outside("lunch_wall"):
            pass


def test_under_a_cpu_clock_training_cpu_time_is_only_the_charges():
    ledger = Ledger(cpu_charges=True)
    ledger.loop_begins()
    busy(0.01)
    with ledger.outside("eval_wall"):
        pass
    assert ledger.train_cpu == 0.0
    ledger.take({"train_wall": 0.5, "train_cpu": 0.25, "examples": 64, "nonfinite_losses": 1})
    assert (ledger.train_wall, ledger.train_cpu, ledger.examples, ledger.nonfinite_losses) == (0.5, 0.25, 64, 1)


def test_the_ledger_state_is_the_resume_checkpoints_totals_and_a_load_counts_a_resume():
    ledger = Ledger(cpu_charges=False)
    ledger.take({"train_wall": 0.5, "train_cpu": 0.25, "examples": 64, "nonfinite_losses": 0})
    state = ledger.state_dict()
    assert list(state) == ["train_cpu", "train_wall", "eval_wall", "checkpoint_wall", "loop_wall",
                           "agent_wait_wall", "examples", "nonfinite_losses", "resumes"]
    resumed = Ledger(cpu_charges=False)
    resumed.load_state_dict(state)
    resumed.load_state_dict(resumed.state_dict())
    assert {**resumed.figures(), "resumes": 0} == state and resumed.resumes == 2


# --------------------------------------------------------------------------------------------------------------
# the judge and the build step


def built_parts(project, entry=None):
    from opalctl.driver.build import build_arm
    from opalctl.protocol.lock import read_lock

    lock = read_lock(project.freeze(budget={"clock": "updates", "amount": 8}, arms={"adamw": support.ADAMW},
                                    entry=entry))
    protocol = lock.protocol()
    parts = build_arm(protocol, protocol.arms["adamw"], 1, lock.parent_path(1),
                      {split: lock.data_path(split) for split in protocol.data})
    return lock, protocol, parts


def test_the_judge_evaluates_a_stage_checkpoint_to_the_metrics_of_the_model_that_saved_it(project, tmp_path):
    from opalctl.driver.arm import make_update
    from opalctl.driver.judge import Judge, SavedStage

    lock, protocol, parts = built_parts(project)
    before = rng_state()
    judge = Judge.build(parts.task, parts.splits, lock.parent_path(1), protocol.arms["adamw"], 1, "cpu", protocol)
    assert _same_rng(before, rng_state()) == [], "building the judge draws nothing from the run's generators"
    def saved_as(name: str) -> SavedStage:
        record = checkpoints.save(tmp_path / name, parts.model.state_dict(), kind="stage")
        return SavedStage(index=0, root=tmp_path, name=name, sha256=record["sha256"],
                          model_sha256=record["model_sha256"], bytes=record["bytes"])

    initial = saved_as("initial.pt")
    update = make_update(parts.task, parts.model, parts.optimizer, parts.clip)
    for _ in range(5):
        update(parts.sampler.next_batch())
    saved = saved_as("stage-01.pt")
    assert judge.evaluate(saved) == evaluate_all(parts.task, parts.model, parts.splits)
    assert judge.model is not parts.model and judge.load_seconds > 0
    assert judge.evaluate(initial) != judge.evaluate(saved)
    with pytest.raises(checkpoints.CheckpointRefused, match="holds another model than the stage saved"):
        judge.evaluate(SavedStage(index=0, root=tmp_path, name=initial.name, sha256=initial.sha256,
                                  model_sha256=saved.model_sha256, bytes=initial.bytes))


@pytest.fixture(scope="module")
def eight_updates(made_project):
    """One formal run of adamw on seed 1 (8 updates) for this module's tests that read it, and the names of the
    checkpoints this process loaded while it ran: ``(project, report, loaded)``; read-only."""
    project = made_project("eight-updates")
    project.freeze(budget={"clock": "updates", "amount": 8}, arms={"adamw": support.ADAMW})
    loaded = []
    load = checkpoints.load

    def spy(path, **kwargs):
        loaded.append(Path(path).name)
        return load(path, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoints, "load", spy)
        report = project.run("adamw", 1)
    return project, report, loaded


def test_a_run_judges_each_stage_from_its_checkpoint_file_in_the_evaluator_process(eight_updates):
    from opalctl.driver.judge import Judge, SavedStage

    project, report, loaded = eight_updates
    assert not [name for name in loaded if name.startswith("stage-")], "the training process loads no stage"
    lock, protocol, parts = built_parts(project)
    judge = Judge.build(parts.task, parts.splits, lock.parent_path(1), protocol.arms["adamw"], 1, "cpu", protocol)
    run_dir = project.run_dir("adamw", 1)
    for stage in report["stages"]:
        saved = SavedStage(index=stage["stage"] - 1, root=run_dir, name=stage["checkpoint"]["file"],
                           sha256=stage["checkpoint"]["sha256"], model_sha256=stage["checkpoint"]["model_sha256"],
                           bytes=stage["checkpoint"]["bytes"])
        assert judge.evaluate(saved) == stage["metrics"]


def test_the_reports_stages_are_the_stage_records_themselves(eight_updates):
    project, report, _ = eight_updates
    files = support.stage_files(project.run_dir("adamw", 1))
    assert report["stages"] == files
    assert [StageRecord.from_json(stage).stage for stage in report["stages"]] == [1, 2, 3, 4]


def test_the_pilot_measures_the_runs_own_first_updates(project):
    from opalctl.driver.pilot import WARMUP, pilot

    entry = project.task_module(NOISY_TASK, "NoisyDigits")
    lock = project.freeze(budget={"clock": "updates", "amount": 40}, arms={"adamw": support.ADAMW}, entry=entry)
    measured = pilot(lock, "adamw", steps=2, seconds=0, seed=1)
    project.run("adamw", 1)
    losses = [line["loss"] for line in read_steps(project.run_dir("adamw", 1) / "training" / "steps.jsonl.gz")]
    warmup = measured["warmup"]
    assert warmup >= WARMUP
    assert (measured["loss_first"], measured["loss_last"]) == (losses[warmup], losses[warmup + 1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_run_on_a_machine_without_cuda_says_what_to_do(project):
    data = project.protocol()
    project.freeze(budget={"clock": "updates", "amount": 8}, arms={"adamw": support.ADAMW},
                   training={**data["training"], "device": "cuda"})
    code, _, err = call_cli(*project.run_args("adamw", 1))
    assert code == 2 and "training.device is cuda but this machine has no CUDA device; run on a machine with a " \
                         "GPU or set training.device: cpu" in err
    assert not project.run_dir("adamw", 1).exists()


@pytest.mark.parametrize("plant", ["symbolic link", "hard link", "folder link on the way", "fifo"])
def test_the_judge_never_follows_a_stage_checkpoint_to_another_file(project, tmp_path, plant):
    """A stage checkpoint the training process replaced by a link to an evaluation split (or anything not a plain
    file it wrote) is refused in one sentence naming it: the unconfined evaluator opens nothing through it."""
    import os

    from opalctl.driver.judge import Judge, SavedStage
    from opalctl.formats import RecordDamaged

    lock, protocol, parts = built_parts(project)
    judge = Judge.build(parts.task, parts.splits, lock.parent_path(1), protocol.arms["adamw"], 1, "cpu", protocol)
    root = tmp_path / "run"
    (root / "training").mkdir(parents=True)
    record = checkpoints.save(root / "training" / "stage-01.pt", parts.model.state_dict(), kind="stage")
    saved = SavedStage(index=0, root=root, name="training/stage-01.pt", sha256=record["sha256"],
                       model_sha256=record["model_sha256"], bytes=record["bytes"])
    split = lock.data_path("selection")
    target = root / "training" / "stage-01.pt"
    target.unlink()
    if plant == "symbolic link":
        target.symlink_to(split)
    elif plant == "hard link":
        os.link(split, target)
    elif plant == "fifo":
        os.mkfifo(target)
    else:
        (root / "training").rmdir()
        (root / "training").symlink_to(split.parent)
    with pytest.raises(RecordDamaged) as refused:
        judge.evaluate(saved)
    message = refused.value.message
    assert str(root / "training" / "stage-01.pt") in message and "\n" not in message, message
    assert {"symbolic link": "is a symbolic link", "hard link": "2 names", "fifo": "not a regular file",
            "folder link on the way": "training on the way is a symbolic link"}[plant] in message, message
