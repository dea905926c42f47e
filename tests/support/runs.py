"""Building formal runs for tests: ``Project``, one test's copy of the built-in digits project (edit the protocol,
freeze it, run arms in this process or as children), the arms, policies and tasks tests share, children started and
waited on, and ``Project.copy`` for a run built once per module (killed, paused, finished) that each test copies
rather than builds again.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from tests.support.cli import child_env, opalctl_command
from tests.support.files import REPO, sha256_of

CHILD_TIMEOUT = 240


class Project:
    """One test's copy of the digits project: edit the protocol, freeze it, run arms."""

    def __init__(self, template: Path, folder: Path, monkeypatch=None):
        """``template`` copied to ``folder``; ``monkeypatch`` (pytest's) undoes the task folders put on
        ``sys.path`` at the test's end (without it, they stay: a module-scoped project)."""
        shutil.copytree(template, folder, ignore=shutil.ignore_patterns(".complete"))
        self.folder = folder
        self.protocol_path = folder / "digits.yaml"
        self.runs = folder.parent / "runs"
        self.lock: Path | None = None
        self.task_paths: list[str] = []
        self._monkeypatch = monkeypatch

    # -- the protocol ----------------------------------------------------------------------------------------
    def protocol(self) -> dict[str, Any]:
        return yaml.safe_load(self.protocol_path.read_text())

    def freeze(self, *, budget: dict | None = None, training: dict | None = None, arms: dict | None = None,
               selection: dict | None = None, entry: str | None = None, limits: dict | None = None) -> Path:
        """Rewrite the protocol (each given section replaces the template's) and freeze it; returns the lock."""
        from opalctl.protocol.freeze import freeze

        data = self.protocol()
        if budget is not None:
            data["budget"] = {"threads": 1, **budget}
        if training is not None:
            data["training"] = {**data["training"], **training}
        if arms is not None:
            data["arms"] = arms
        if selection is not None:
            data["selection"] = selection
        if entry is not None:
            data["task"]["entry"] = entry
        if limits is not None:
            data["limits"] = limits
        self.protocol_path.write_text(yaml.safe_dump(data, sort_keys=False))
        self.lock = Path(freeze(self.protocol_path, force=True)["lock"])
        return self.lock

    def task_module(self, source: str, class_name: str) -> str:
        """Write a task module with a name unique to this test; returns the protocol's ``task.entry``."""
        name = f"opalctl_test_task_{uuid.uuid4().hex[:12]}"
        folder = self.folder / "tasks"
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.py").write_text(source)
        self._on_path(str(folder))
        return f"{name}:{class_name}"

    def _on_path(self, folder: str) -> None:
        if self._monkeypatch is not None:
            self._monkeypatch.syspath_prepend(folder)
        elif folder not in sys.path:
            sys.path.insert(0, folder)
        self.task_paths.append(folder)

    # -- runs ------------------------------------------------------------------------------------------------
    @property
    def base(self) -> Path:
        assert self.lock is not None, "freeze the project first"
        return self.runs / f"digits-{sha256_of(self.lock)[:12]}"

    def run_dir(self, arm: str, seed: int, runs: Path | None = None) -> Path:
        base = self.base if runs is None else Path(runs) / self.base.name
        return base / arm / f"seed-{seed}"

    def run(self, arm: str, seed: int, **kwargs) -> dict[str, Any]:
        from opalctl.driver.run import run

        kwargs.setdefault("runs_dir", self.runs)
        return run(self.lock, arm, seed, **kwargs)

    def env(self, **extra: str) -> dict[str, str]:
        env = child_env(clean=True)
        paths = self.task_paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(extra)
        return env

    def process(self, args: list[str], *, env: dict[str, str] | None = None, python: list[str] | None = None,
                timeout: float = CHILD_TIMEOUT) -> subprocess.CompletedProcess:
        """``python -m opalctl ARGS`` (or ``python PYTHON... ARGS``) in a child process, cwd the test's folder."""
        command = [sys.executable, *python, *args] if python else opalctl_command(*args)
        return subprocess.run(command, cwd=self.folder.parent, env=env or self.env(), capture_output=True,
                              text=True, timeout=timeout)

    def run_args(self, arm: str, seed: int, *more: str, runs: Path | None = None) -> list[str]:
        return ["run", str(self.lock), "--arm", arm, "--seed", str(seed), "--runs-dir", str(runs or self.runs),
                *more]

    @classmethod
    def frozen_at(cls, folder: Path, root: Path, monkeypatch=None) -> Project:
        """A copy at ``root / "project"`` of the project frozen at ``folder`` (made once per session, perhaps by
        another xdist worker, so only its files are known): its one lock found again, its task folder on the path."""
        copied = cls(folder, root / "project", monkeypatch)
        (copied.lock,) = copied.folder.glob("digits*.lock.json")
        if (copied.folder / "tasks").is_dir():
            copied._on_path(str(copied.folder / "tasks"))
        return copied

    def copy(self, root: Path, monkeypatch=None) -> Project:
        """This project (frozen) and its runs copied to ``root / "project"`` and ``root / "runs"``: a test's own copy
        of runs built once (the lock and its records name files relative to the lock, so the copy verifies)."""
        assert self.lock is not None, "freeze the project first"
        if self.runs.exists():
            shutil.copytree(self.runs, root / "runs", symlinks=True)
        copied = Project(self.folder, root / "project", monkeypatch)
        copied.lock = copied.folder / self.lock.relative_to(self.folder)
        for path in self.task_paths:
            copied._on_path(str(copied.folder / Path(path).relative_to(self.folder)))
        return copied


# Arms and policies the tests share ---------------------------------------------------------------------------

ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}
ADAMW_HIGH = {"optimizer": {"name": "AdamW", "lr": 3.0e-2}}
DENOMINATORS = ["selection.total", "retention.total"]
LENIENT = {"denominators": DENOMINATORS, "floors": {"retention.correct": 128}, "improve_any": ["selection.correct"]}

# A run stopped at a known update ---------------------------------------------------------------------------

PAUSE_TASK = '''
import os
import time
from pathlib import Path

from opalctl.files import atomic_write_text
from opalctl.tasks.digits import Digits


class PausingDigits(Digits):
    """At the N-th loss of its training process: with FAIL_AT=N it fails; with PAUSE_AT=N it writes its process
    id into PAUSE_FILE and waits until RELEASE_FILE exists (a signal ends the wait), so a test acts on a run that
    stands still mid-update."""

    def loss(self, model, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if os.environ.get("FAIL_AT") == str(self.calls):
            raise RuntimeError("the test stops this run here")
        if os.environ.get("PAUSE_AT") == str(self.calls):
            atomic_write_text(os.environ["PAUSE_FILE"], str(os.getpid()), durable=False)  # it appears whole
            release, deadline = Path(os.environ.get("RELEASE_FILE", os.devnull + ".never")), time.monotonic() + 120
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().loss(model, batch)
'''

# a task that kills its own training process at its N-th loss call (KILL_LOSS_AT), as a SIGKILL from outside would
KILLABLE_TASK = '''
import os
import signal

from opalctl.tasks.digits import Digits

CALLS = [0]


class KillableDigits(Digits):
    def loss(self, model, batch):
        CALLS[0] += 1
        if os.environ.get("KILL_LOSS_AT") == str(CALLS[0]):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(model, batch)
'''

# the agent's answer the loopback Messages server gives in a real run: the shipped updater with its learning rate
# halved, and a rationale of the usual four parts (tests/driver/test_agent_keys.py, test_verdict_holds.py)
DEFAULT_UPDATER = (REPO / "opalctl" / "opal" / "defaults" / "updater.py").read_text()
HALVED = DEFAULT_UPDATER.replace("LR_SCALE = 1.0", "LR_SCALE = 0.5", 1)
RATIONALE = ("Observed: the loss falls steadily.\nChanged: LR_SCALE 1.0 -> 0.5 in updater.py.\n"
             "Prediction: smoother; wrong if it stalls.\nRules: LR_SCALE is a schedule.")


def messages_server():
    """tests/opal/messages_server.py, the loopback Messages API, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "messages_server", REPO / "tests" / "opal" / "messages_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the files a finished run folder holds with the fractions [0.25, 0.5, 0.75, 1.0]: its records and nothing else
# (training's own files under training/, opalctl/layout.py)
FINISHED_FILES = sorted(["initial.pt", "last.json", "report.json", "selected.json", "start.json",
                         "training/steps.jsonl.gz", *[f"stage-0{k}.json" for k in range(1, 5)],
                         *[f"training/stage-0{k}.pt" for k in range(1, 5)]])


def wait_for(path: Path, child: subprocess.Popen, timeout: float = CHILD_TIMEOUT) -> None:
    """Until ``path`` exists; a child that ended first fails the test with its output."""
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if child.poll() is not None:
            out, err = child.communicate()
            raise AssertionError(f"the child ended (exit {child.returncode}) before {path}: {err[-2000:]}")
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.02)


def spawn(project: Project, args: list[str], *, new_session: bool = False, **env: str) -> subprocess.Popen:
    """``python -m opalctl ARGS`` started and left running (``project.process`` waits for its end); with
    ``new_session`` in a process group of its own, as a terminal would start it."""
    return subprocess.Popen(opalctl_command(*args), cwd=project.folder.parent,
                            env=project.env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)



def killed_at(project: Project, arm: str, seed: int, loss_call: int) -> Path:
    """Run ``arm`` on ``seed`` as a child that ``KILLABLE_TASK`` kills at its ``loss_call``-th loss (the project
    frozen on that task); returns the run folder, asserting the child died. Build it once per module
    (``made_project`` in tests/driver/conftest.py) and give each test ``Project.copy``."""
    run_dir = project.run_dir(arm, seed)
    result = project.process(project.run_args(arm, seed), env=project.env(KILL_LOSS_AT=str(loss_call)))
    assert result.returncode != 0, f"the run was not killed at loss call {loss_call}: {result.stderr[-2000:]}"
    return run_dir
