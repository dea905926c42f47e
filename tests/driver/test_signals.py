"""SIGINT, SIGTERM and SIGHUP each stop a run mid-update, leave it resumable, print the one line that continues it
and exit 128 + the signal's number; ``--resume`` then ends with the weights of an uninterrupted run.

The children are real ``python -m opalctl run`` processes in a session of their own, standing still inside
update 13 (``PAUSE_TASK``) when the test signals them: SIGINT and SIGHUP go to the whole process group, as a
terminal sends them (Ctrl-C, a closed window), SIGTERM to the run's process alone, as ``kill`` or the grid sends it.

A stop waits for the update in progress to end and writes the resume checkpoint at it, so nothing trained is
lost (at a random moment of a long run too); an update that does not end within ``STOP_WAIT_SECONDS`` is left,
and the sentence says how many updates the resume trains again. A stop that comes once ``report.json`` is
written ends a finished run.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import time

import pytest

from opalctl import checkpoints
from tests import support
from tests.support.cli import call_cli

STOPS = [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, True)]


def resume_update(run_dir) -> int:
    return checkpoints.load(run_dir / "training" / "resume.pt", require_finite=False)["meta"]["update"]



def test_sigint_sigterm_and_sighup_each_stop_a_run_that_resumes_to_the_weights_of_an_uninterrupted_run(
        pausing, pausing_reference, tmp_path):
    project, (_, uninterrupted) = pausing, pausing_reference
    children = {}
    for number, _ in STOPS:
        runs = tmp_path / number.name
        children[number] = (runs, support.spawn(project, project.run_args("adamw", 1, runs=runs), new_session=True,
                                              PAUSE_AT="13", PAUSE_FILE=str(tmp_path / f"{number.name}.paused"),
                                              RELEASE_FILE=str(tmp_path / f"{number.name}.release")))

    stopped = {}
    for number, group in STOPS:
        runs, child = children[number]
        support.wait_for(tmp_path / f"{number.name}.paused", child)
        (os.killpg if group else os.kill)(child.pid, number)
        time.sleep(0.5)  # the stop waits for the update in progress (the 13th) to end
        assert child.poll() is None, "a stop waits for the update in progress"
        (tmp_path / f"{number.name}.release").write_text("go")
        _, err = child.communicate(timeout=support.CHILD_TIMEOUT)
        command = shlex.join(["opalctl", *project.run_args("adamw", 1, "--resume", runs=runs)])
        assert child.returncode == 128 + number, err[-2000:]
        said = [line for line in err.strip().splitlines() if not line.startswith("stage ")]  # the rest: its stages
        assert said == [f"opalctl: interrupted ({number.name}); resume with: {command}"], err[-2000:]
        run_dir = project.run_dir("adamw", 1, runs=runs)
        assert not (run_dir / "report.json").exists()
        # the resume checkpoint at the update the stop waited for, not the periodic one at update 10
        assert resume_update(run_dir) == 13
        stopped[number] = (run_dir, command)

    # every stop left the same state to resume from (model, optimizer, sampler, RNG), so resuming one of them to the
    # weights of the uninterrupted run (below) stands for the three: the signal changes only how the run stopped
    states = {number: resume_state(run_dir) for number, (run_dir, _) in stopped.items()}
    for number, _ in STOPS[1:]:
        assert states[number] == states[STOPS[0][0]], f"{number.name} left another state than SIGINT"

    run_dir, command = stopped[signal.SIGHUP]
    (run_dir / ".report.json.stale.tmp").write_text("{")  # as a write a killed session never finished leaves
    code, _, err = call_cli(*shlex.split(command)[1:])  # what the line says to type
    assert code == 0, err
    report = support.read(run_dir / "report.json")
    assert report["final_model_sha256"] == uninterrupted["final_model_sha256"] and report["resumes"] == 1
    assert report["rows_digest"] == uninterrupted["rows_digest"]
    assert support.files_of(run_dir) == support.FINISHED_FILES


TRAINING_STATE = ("optimizer", "sampler", "schedule", "stages", "next_checkpoint", "steps_lines", "steps_seen")


def resume_state(run_dir) -> dict:
    """What ``resume.pt`` carries to train on from, tensors by their digests: the model, the optimizer, the sampler,
    the schedule, torch's generator, the stages passed and the steps lines counted (not the time figures of the
    ledger and the steps lines, nor the generators of numpy and Python, which each process seeds its own way and
    the digits task never draws from)."""
    import torch

    def plain(value):
        if isinstance(value, torch.Tensor):
            return checkpoints.tensor_sha256(value)
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(item) for item in value]
        return value

    payload = checkpoints.load(run_dir / "training" / "resume.pt", require_finite=False)
    extra = payload["extra"]
    return {"model": payload["model_sha256"], "meta": payload["meta"], "torch_rng": plain(extra["rng"]["torch"]),
            **{key: plain(extra[key]) for key in TRAINING_STATE}}


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_sigterm_or_sighup_inside_agent_code_stops_the_run_as_a_ctrl_c_does_and_is_not_taken_for_its_failure(
        number):
    from opalctl.driver.run import StopSignals
    from opalctl.opal.guard import Interrupts, contained

    def agent_code():
        signal.raise_signal(number)
        time.sleep(5)  # the signal's handler ends the wait
        return "went on"

    with StopSignals() as stops:
        Interrupts.shared().install()  # as wrapping an agent optimizer does, over the run's handler
        with pytest.raises(KeyboardInterrupt):
            contained(agent_code)
    assert stops.received == number


# every loss call of the training process writes its number (COUNT_FILE): the updates a stopped run had begun
COUNTING_TASK = '''
import os

from opalctl.tasks.digits import Digits


class CountingDigits(Digits):
    def loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if "COUNT_FILE" in os.environ:  # whole or not at all, however the process ends
            with open(os.environ["COUNT_FILE"] + ".tmp", "w") as handle:
                handle.write(str(self.calls))
            os.replace(os.environ["COUNT_FILE"] + ".tmp", os.environ["COUNT_FILE"])
        return super().loss(model, batch)
'''

LONG = 2000  # updates; stages, and so resume checkpoints, every 500: a stop that does not wait loses up to 499


def test_a_sigterm_at_a_random_moment_of_a_long_run_loses_at_most_the_update_in_progress(project, tmp_path):
    entry = project.task_module(COUNTING_TASK, "CountingDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": LONG}, training={"checkpoint_every": 0.5},
                   arms={"adamw": support.ADAMW})
    count = tmp_path / "count"
    child = support.spawn(project, project.run_args("adamw", 1), COUNT_FILE=str(count))
    uninterrupted = project.run("adamw", 1, runs_dir=tmp_path / "reference")  # while the child starts
    support.wait_for(count, child)
    time.sleep(random.uniform(0.0, 0.5))
    os.kill(child.pid, signal.SIGTERM)
    _, err = child.communicate(timeout=support.CHILD_TIMEOUT)
    begun = int(count.read_text())
    run_dir = project.run_dir("adamw", 1)
    assert child.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert 0 < begun < LONG, f"the stop landed at update {begun}, outside the loop: sleep less"
    assert err.strip().splitlines()[-1].startswith("opalctl: interrupted (SIGTERM); resume with: "), err[-2000:]
    assert begun - resume_update(run_dir) <= 1, f"{begun} updates begun, the resume starts at {resume_update(run_dir)}"

    code, _, err = call_cli(*project.run_args("adamw", 1, "--resume"))
    assert code == 0, err
    assert f"resuming {run_dir} at update {resume_update_said(err)}" in err
    report = support.read(run_dir / "report.json")
    assert report["final_model_sha256"] == uninterrupted["final_model_sha256"] and report["resumes"] == 1
    assert report["rows_digest"] == uninterrupted["rows_digest"] and report["updates"] == LONG
    # the evaluator's records agree: every stage judged once, at the same update, with the same results
    assert [(s["stage"], s["update"], s["metrics"], s["promoted"]) for s in report["stages"]] == \
        [(s["stage"], s["update"], s["metrics"], s["promoted"]) for s in uninterrupted["stages"]]
    assert support.files_of(run_dir) == support.FINISHED_FILES


def resume_update_said(err: str) -> int:
    line = next(line for line in err.splitlines() if line.startswith("resuming "))
    return int(line.rsplit(" ", 1)[1])


def test_a_stop_that_the_update_in_progress_does_not_let_wait_ends_at_the_bound_saying_what_is_trained_again(
        pausing, pausing_reference, tmp_path):
    from opalctl.driver.run import STOP_WAIT_SECONDS

    project, (_, uninterrupted) = pausing, pausing_reference
    child = support.spawn(project, project.run_args("adamw", 1), PAUSE_AT="13", PAUSE_FILE=str(tmp_path / "paused"))
    support.wait_for(tmp_path / "paused", child)
    signalled = time.monotonic()
    os.kill(child.pid, signal.SIGTERM)  # the 13th update never ends by itself (no RELEASE_FILE)
    _, err = child.communicate(timeout=support.CHILD_TIMEOUT)
    waited = time.monotonic() - signalled
    command = shlex.join(["opalctl", *project.run_args("adamw", 1, "--resume")])
    assert child.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert STOP_WAIT_SECONDS <= waited < STOP_WAIT_SECONDS + 20, waited
    assert err.strip().splitlines()[-1] == (
        f"opalctl: interrupted (SIGTERM) before the update in progress ended (it waited {STOP_WAIT_SECONDS:g} s), "
        f"so no resume checkpoint was written at the stop: the resume starts at update 10, and trains the 2 "
        f"update(s) done since then again; resume with: {command}"), err[-2000:]
    run_dir = project.run_dir("adamw", 1)
    assert resume_update(run_dir) == 10

    code, _, err = call_cli(*shlex.split(command)[1:])
    assert code == 0, err
    report = support.read(run_dir / "report.json")
    assert report["final_model_sha256"] == uninterrupted["final_model_sha256"] and report["resumes"] == 1


def test_a_stop_waiting_for_the_update_never_interrupts_agent_code_and_past_the_bound_is_the_users_stop():
    from opalctl.driver.run import StopSignals
    from opalctl.opal.guard import Interrupts, contained

    def agent_code():
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.2)  # the stop waits: the program is not interrupted
        return "went on"

    def hung_agent_code():
        time.sleep(30)  # ended by the stop, at its bound
        return "never"

    with StopSignals(wait=1.0) as stops:
        Interrupts.shared().install()  # as wrapping an agent optimizer does, over the run's handler
        with stops.deferred() as asked:
            assert contained(agent_code) == ("went on", None) and asked == [signal.SIGTERM]
            started = time.monotonic()
            with pytest.raises(KeyboardInterrupt):  # the user's stop, not the program's failure
                contained(hung_agent_code)
            assert time.monotonic() - started < 5
    assert stops.received == signal.SIGTERM


# the training process sends itself SIGTERM as soon as the evaluator has answered its CLOSE: report.json written
STOP_AFTER_CLOSE = '''
import os
import signal
import sys

from opalctl.driver.evaluator import EvaluatorProcess, Message

original = EvaluatorProcess.ask


def ask(self, kind, *args, **kwargs):
    answer = original(self, kind, *args, **kwargs)
    if kind == Message.CLOSE:
        os.kill(os.getpid(), signal.SIGTERM)
    return answer


EvaluatorProcess.ask = ask

from opalctl.cli import main

main(sys.argv[1:])
'''


def test_a_sigterm_that_lands_just_after_report_json_is_written_ends_a_finished_run(pausing, pausing_reference):
    project, (_, uninterrupted) = pausing, pausing_reference
    result = project.process(project.run_args("adamw", 1), python=["-c", STOP_AFTER_CLOSE])
    run_dir = project.run_dir("adamw", 1)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"the stop (SIGTERM) came after the run finished; its report is {run_dir / 'report.json'}" in \
        result.stderr, result.stderr[-2000:]
    assert "--restart" not in result.stderr and "interrupted" not in result.stderr
    assert str(run_dir) in result.stdout  # the finished run's table
    report = support.read(run_dir / "report.json")
    assert report["updates"] == 20 and report["final_model_sha256"] == uninterrupted["final_model_sha256"]
    assert support.files_of(run_dir) == support.FINISHED_FILES
