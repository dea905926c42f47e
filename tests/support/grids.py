"""Building grids for tests: a frozen digits protocol on a task that can be held at an update, and reading them.

Real runs are costly (each ``opalctl run`` starts three Python processes), so the protocol is frozen once per
module, on the ``updates`` clock with a small budget, and the uninterrupted reference of each (arm, seed) is run
once, in this process, when a test first asks for it. The task (``GatedDigits``) is the built-in digits task
whose ``loss`` stops at its ``GATE_AT``-th call in a process and waits there until the gate folder holds a file
named ``open``; each waiting process leaves a file ``waiting-PID`` first, so a test knows when every run of a
grid is in the middle of its budget. Waiting costs nothing on the ``updates`` clock, so a held run ends with the
same digests as one that never waited. A held run asked to stop (a grid's Ctrl-C, Slurm's preemption) is let go at
once, as an update that ends soon after a stop would be: the stop is then the kind that waits for the update and
writes its checkpoint there, and the test does not sit out the ten seconds of the stop's bound.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.support.cli import call_cli, child_env, opalctl_command

UPDATES = 200  # checkpoint_every 0.05: a resume checkpoint every 10 updates
GATE_AT = 120
ARMS = {"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}},
        "cosine": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}, "schedule": "cosine"},
        "spare": {"optimizer": {"name": "SGD", "lr": 1.0e-2}}}

GATED_TASK = '''
import os
import sys
import time
from pathlib import Path

from opalctl.tasks.digits import Digits

CALLS = [0]


def stop_asked():
    # read from the training process's own run module: the evaluator, which imports this task too, never loads it
    run = sys.modules.get("opalctl.driver.run")
    active = run.StopSignals.active if run is not None else None
    return active is not None and bool(active.asked)


class GatedDigits(Digits):
    def loss(self, model, batch):
        CALLS[0] += 1
        gate = os.environ.get("GRID_TEST_GATE")
        if gate and CALLS[0] == int(os.environ.get("GRID_TEST_GATE_AT", "0")):
            gate = Path(gate)
            if not (gate / "open").exists():
                (gate / f"waiting-{os.getpid()}").write_text("")
                while not (gate / "open").exists() and not stop_asked():
                    time.sleep(0.02)
        return super().loss(model, batch)
'''


class GridProject:
    """A frozen digits protocol on the gated task, its gate, and uninterrupted reference runs."""

    def __init__(self, template: Path, folder: Path, *, updates: int = UPDATES, ranks: int = 1,
                 arms: dict | None = None):
        shutil.copytree(template, folder)
        self.folder = folder
        tasks = folder / "tasks"
        tasks.mkdir()
        (tasks / "grid_gated_task.py").write_text(GATED_TASK)
        self.task_path = str(tasks)
        protocol = folder / "digits.yaml"
        data = yaml.safe_load(protocol.read_text())
        data["task"]["entry"] = "grid_gated_task:GatedDigits"
        data["budget"] = {"clock": "updates", "amount": updates, "threads": 1, "fractions": [0.5, 1.0]}
        data["training"] = {**data["training"], "checkpoint_every": 0.05, "ranks": ranks}
        data["arms"] = arms or ARMS
        data["selection"] = {"denominators": ["selection.total", "retention.total"],
                             "floors": {"retention.correct": 128}, "improve_any": ["selection.correct"]}
        protocol.write_text(yaml.safe_dump(data, sort_keys=False))
        from opalctl.protocol.freeze import freeze

        if self.task_path not in sys.path:
            sys.path.insert(0, self.task_path)
        self.lock = Path(freeze(protocol, force=True)["lock"])
        self.references: dict[tuple[str, int], dict] = {}

    def env(self, gate: Path | None = None) -> dict[str, str]:
        env = child_env(clean=True)
        env["PYTHONPATH"] = os.pathsep.join([self.task_path, *filter(None, [os.environ.get("PYTHONPATH")])])
        if gate is not None:
            env.update({"GRID_TEST_GATE": str(gate), "GRID_TEST_GATE_AT": str(GATE_AT)})
        return env

    def reference(self, arm: str, seed: int) -> dict:
        """The report of an uninterrupted run of ``arm`` on ``seed`` (run in this process once)."""
        if (arm, seed) not in self.references:
            from opalctl.driver.run import run

            self.references[arm, seed] = run(self.lock, arm, seed, runs_dir=self.folder.parent / "reference")
        return self.references[arm, seed]

    def status(self, *args: str, runs: Path) -> dict:
        """``opalctl grid LOCK --status --json`` (in this process: it only reads the runs' folders): where every run
        stands."""
        done = call_cli("grid", self.lock, "--status", *args, "--runs-dir", runs, "--json")
        assert done.code == 0, done.stderr
        return done.json()

    def run(self, arm: str, seed: int, *, runs: Path, gate: Path | None = None) -> subprocess.Popen:
        """A plain ``python -m opalctl run`` of ``arm`` on ``seed`` as a child process (output to a pipe)."""
        command = opalctl_command("run", self.lock, "--arm", arm, "--seed", seed, "--runs-dir", runs)
        return subprocess.Popen(command, cwd=self.folder.parent, env=self.env(gate), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    def grid(self, *args: str, runs: Path, gate: Path | None = None) -> subprocess.Popen:
        """``python -m opalctl grid LOCK ARGS --runs-dir RUNS --json`` as a child process."""
        command = opalctl_command("grid", self.lock, *args, "--runs-dir", runs, "--json")
        return subprocess.Popen(command, cwd=self.folder.parent, env=self.env(gate), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = 120.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def stop(process: subprocess.Popen, signum: int = signal.SIGINT) -> None:
    if process.poll() is None:
        process.send_signal(signum)


class Lines:
    """Every line a child prints on stdout and stderr, read by threads as they come, so that a test can wait for
    a line while the child runs (``wait``) and still have them all at the end (``finish``)."""

    def __init__(self, process: subprocess.Popen):
        import threading

        self.process, self.out, self.err = process, [], []
        self.threads = [threading.Thread(target=self._read, args=(stream, into), daemon=True)
                        for stream, into in ((process.stdout, self.out), (process.stderr, self.err)) if stream]
        for thread in self.threads:
            thread.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    def events(self) -> list[dict]:
        return events("".join(self.out))

    def wait(self, predicate, timeout: float, what: str) -> None:
        wait_for(lambda: predicate(self.events()) or self.process.poll() is not None, timeout, what)
        assert self.process.poll() is None, f"it ended before {what}: {''.join(self.err)[-4000:]}"

    def finish(self, timeout: float) -> tuple[int, list[dict], str]:
        code = self.process.wait(timeout=timeout)
        for thread in self.threads:
            thread.join(timeout=30)
        return code, self.events(), "".join(self.err)


def states(lines: list[dict]) -> dict[str, str]:
    """arm -> the last state a grid's JSON lines gave it."""
    return {line["arm"]: line["state"] for line in lines if line.get("event") == "run"}


HOLDER = """
import sys
from opalctl.driver.run import FolderLock
from opalctl.layout import RunLayout

lock = FolderLock(RunLayout.of(sys.argv[1]))
lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


class HeldFolder:
    """A helper process that takes a run folder's lock as ``opalctl run`` does (driver/run.py ``FolderLock``) and
    holds it until ``release``: a real lock held by a live process other than the test's."""

    def __init__(self, run_dir: Path):
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "held", "the helper could not take the folder's lock"

    def release(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)

    def __enter__(self) -> HeldFolder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def run_folder(project: GridProject, runs: Path, arm: str, seed: int) -> Path:
    from opalctl.layout import LockRuns
    from opalctl.protocol.lock import read_lock

    return LockRuns.of(runs, read_lock(project.lock)).run(arm, seed).root


SAME_RUN_KEYS = ("final_model_sha256", "rows_digest", "updates", "promoted_stages", "selected")


def same_run(report: dict, reference: dict) -> dict:
    """The keys that differ between a run's report and its uninterrupted reference's (empty: the same run)."""
    return {key: (report.get(key), reference.get(key)) for key in SAME_RUN_KEYS if report.get(key) != reference.get(key)}
