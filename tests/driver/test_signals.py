"""SIGINT, SIGTERM and SIGHUP each stop a run mid-update, leave it resumable, print the one line that continues it
and exit 128 + the signal's number; ``--resume`` then ends with the weights of an uninterrupted run.

The children are real ``python -m opalctl run`` processes in a session of their own, standing still inside
update 13 (``PAUSE_TASK``) when the test signals them: SIGINT and SIGHUP go to the whole process group, as a
terminal sends them (Ctrl-C, a closed window), SIGTERM to the run's process alone, as ``kill`` or the grid sends it.
"""

from __future__ import annotations

import os
import shlex
import signal
import time

import pytest

STOPS = [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, True)]



def test_sigint_sigterm_and_sighup_each_stop_a_run_that_resumes_to_the_weights_of_an_uninterrupted_run(
        pausing, tools, main_cli, tmp_path):
    project = pausing
    children = {}
    for number, _ in STOPS:
        runs = tmp_path / number.name
        children[number] = (runs, tools.spawn(project, project.run_args("adamw", 1, runs=runs), new_session=True,
                                              PAUSE_AT="13", PAUSE_FILE=str(tmp_path / f"{number.name}.paused")))
    uninterrupted = project.run("adamw", 1, runs_dir=tmp_path / "reference")  # while the children start

    for number, group in STOPS:
        runs, child = children[number]
        tools.wait_for(tmp_path / f"{number.name}.paused", child)
        (os.killpg if group else os.kill)(child.pid, number)
        _, err = child.communicate(timeout=tools.CHILD_TIMEOUT)
        command = shlex.join(["opalctl", *project.run_args("adamw", 1, "--resume", runs=runs)])
        assert child.returncode == 128 + number, err[-2000:]
        said = [line for line in err.strip().splitlines() if not line.startswith("stage ")]  # the rest: its stages
        assert said == [f"opalctl: interrupted ({number.name}); resume with: {command}"], err[-2000:]
        run_dir = project.run_dir("adamw", 1, runs=runs)
        assert (run_dir / "training" / "resume.pt").exists() and not (run_dir / "report.json").exists()
        (run_dir / ".report.json.stale.tmp").write_text("{")  # as a write a killed session never finished leaves

        code, _, err = main_cli(shlex.split(command)[1:])  # what the line says to type
        assert code == 0, err
        report = tools.read(run_dir / "report.json")
        assert report["final_model_sha256"] == uninterrupted["final_model_sha256"] and report["resumes"] == 1
        assert report["rows_digest"] == uninterrupted["rows_digest"]
        assert tools.files_of(run_dir) == tools.FINISHED_FILES


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
