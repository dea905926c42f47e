"""One run per folder, decided under the folder's lock; a resume that cannot continue asks for ``--restart``,
which keeps the abandoned attempt; a resume refuses records that are not those its checkpoint counts; a finished
folder holds its records and nothing else."""

from __future__ import annotations

import gzip
import json
import time

from opalctl.driver.records import read_steps
from tests.support.cli import call_cli
from tests.support.files import read, snapshot
from tests.support.runs import CHILD_TIMEOUT, FINISHED_FILES, spawn


def names(folder):
    """Every file beneath a run folder, by its name relative to it."""
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())


def paused_pid(pause, children, timeout):
    """The pid the run standing still at its pause wrote; a child that failed first fails the test."""
    deadline, pids = time.monotonic() + timeout, {str(child.pid) for child in children}
    while not pause.exists() or pause.read_text() not in pids:  # a read may come before the write is whole
        for child in children:
            if child.poll() not in (None, 2):
                raise AssertionError(f"a run ended (exit {child.returncode}) before {pause}: "
                                     f"{child.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, f"no {pause} after {timeout} s"
        time.sleep(0.02)
    return int(pause.read_text())


def test_two_runs_of_one_arm_and_seed_started_together_train_once_and_the_second_is_refused_naming_the_folder(
        pausing, pausing_reference, tmp_path):
    project, run_dir = pausing, pausing.run_dir("adamw", 1)
    alone_dir, alone = pausing_reference  # the same run with no neighbour
    pause, release = tmp_path / "paused", tmp_path / "release"
    # both race for the folder; the one that trains stands still at update 12 until released
    together = [spawn(project, project.run_args("adamw", 1), PAUSE_AT="12", PAUSE_FILE=str(pause),
                      RELEASE_FILE=str(release)) for _ in range(2)]
    pid = paused_pid(pause, together, CHILD_TIMEOUT)
    trains = next(child for child in together if child.pid == pid)
    refused = next(child for child in together if child is not trains)
    _, err = refused.communicate(timeout=CHILD_TIMEOUT)
    assert refused.returncode == 2, err[-2000:]
    refusal = err.strip().splitlines()
    assert len(refusal) == 1 and refusal[0].startswith("opalctl: error: ") and str(run_dir) in refusal[0]

    # while the run stands at update 12, a second --resume (or run) of it is refused at once, changing nothing
    before = snapshot(run_dir.parent)
    for more in (["--resume"], []):
        code, out, err = call_cli(*project.run_args("adamw", 1, *more))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert f"another opalctl process (pid {pid}) is running {run_dir} now" in err
    assert snapshot(run_dir.parent) == before
    release.touch()
    assert trains.wait(timeout=CHILD_TIMEOUT) == 0, trains.communicate()[1][-2000:]

    survivor = read(run_dir / "report.json")
    assert survivor["final_model_sha256"] == alone["final_model_sha256"] and survivor["resumes"] == 0
    assert [s["update"] for s in read_steps(run_dir / "training" / "steps.jsonl.gz")] == list(range(1, 21))
    # a finished folder holds its records and nothing else: no lock, no marker, no temporary file
    assert names(run_dir) == names(alone_dir) == FINISHED_FILES
    assert sorted(path.name for path in run_dir.parent.iterdir()) == [".seed-1.lock", "seed-1"]


def test_resume_without_its_checkpoint_asks_for_restart_which_keeps_the_attempt_aside_and_never_restarts_a_finished_run(
        pausing_failed, pausing_reference):
    project, run_dir = pausing_failed, pausing_failed.run_dir("adamw", 1)  # failed by its task at update 13
    (run_dir / "training" / "resume.pt").unlink()
    abandoned = snapshot(run_dir)
    before = snapshot(project.runs)

    for more in (["--resume"], []):
        code, out, err = call_cli(*project.run_args("adamw", 1, *more))
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1 and str(run_dir) in lines[0], err
        assert f"{' '.join(project.run_args('adamw', 1, '--restart'))}`" in lines[0]
    assert "resume.pt is missing" in call_cli(*project.run_args("adamw", 1, "--resume")).stderr
    assert snapshot(project.runs) == before, "a refused start changes nothing"

    code, _, err = call_cli(*project.run_args("adamw", 1, "--restart"))
    assert code == 0, err
    assert snapshot(run_dir.parent / "seed-1.abandoned-1") == abandoned, "the abandoned attempt is kept whole"
    restarted = read(run_dir / "report.json")
    _, uninterrupted = pausing_reference
    assert restarted["final_model_sha256"] == uninterrupted["final_model_sha256"] and restarted["resumes"] == 0
    assert names(run_dir) == FINISHED_FILES

    finished = snapshot(project.runs)
    code, out, err = call_cli(*project.run_args("adamw", 1, "--restart"))
    assert code == 2 and "already finished" in err and "never restarted" in err and str(run_dir) in err
    assert snapshot(project.runs) == finished


def rewrite_steps(path, forge):
    """The steps file written again as valid gzip with as many lines, ``forge`` changing the lines' dicts."""
    lines = list(read_steps(path))
    forge(lines)
    path.write_bytes(gzip.compress("".join(json.dumps(line) + "\n" for line in lines).encode()))


def test_a_resume_refuses_steps_records_rewritten_with_as_many_lines_and_a_changed_or_missing_start_record(
        pausing_failed, monkeypatch):
    # failed by its task at update 13: the resume checkpoint of update 10 counts 10 steps lines
    project, run_dir = pausing_failed, pausing_failed.run_dir("adamw", 1)
    steps, start = run_dir / "training" / "steps.jsonl.gz", run_dir / "start.json"
    written = {path: path.read_bytes() for path in (steps, start)}

    def forged_loss(lines):
        lines[3]["loss"] = 0.5  # every rows digest still chains: only the bytes tell

    def edited_start():
        record = read(start)
        record["seed"] = 2
        start.write_text(json.dumps(record, indent=2) + "\n")

    for damage, named, words in [(lambda: rewrite_steps(steps, forged_loss), steps, "rewritten"),
                                 (edited_start, start, "is not the one this run wrote"),
                                 (start.unlink, start, "is missing")]:
        damage()
        before = snapshot(project.runs)
        code, out, err = call_cli(*project.run_args("adamw", 1, "--resume"))
        lines = err.strip().splitlines()
        assert code == 3 and out == "" and len(lines) == 1, err
        assert str(named) in lines[0] and words in lines[0] and "--restart" in lines[0], lines[0]
        assert snapshot(project.runs) == before, "a refused resume changes nothing"
        for path, data in written.items():
            path.write_bytes(data)

    import opalctl.driver.run as formal

    located, locate = [], formal.locate  # the steps file is decompressed once on the resume, not once per look
    monkeypatch.setattr(formal, "locate", lambda path, lines: located.append(lines) or locate(path, lines))
    code, _, err = call_cli(*project.run_args("adamw", 1, "--resume"))
    assert code == 0, err
    assert read(run_dir / "report.json")["resumes"] == 1
    assert located == [10]
