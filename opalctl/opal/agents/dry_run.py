"""The ``check_programs`` tool: a dry run of the workspace's ``updater.py`` and ``analysis.py`` on stand-ins.

The static check, ``build()`` on stand-in tensors of the run's real parameter shapes and dtypes wrapped in a fresh
AdamW, one step on random gradients, ``state_dict()`` / ``load_state_dict()``, one ``analyze()``; the answer is the
error text, or None when the programs pass. torch is imported when a dry run starts, not with this module.

A dry run executes the agent's code, so the backends run it in a child process of its own (``check_in_child``:
``python -m opalctl.opal.agents.dry_run``), with the secret-looking variables taken out of its environment, a
time limit, and, where ``opalctl.sandbox`` is there, no network, no writes, and nothing to read but what training
reads (``training_paths``) and the workspace, which is always the agent host's own, fixed when the host started
(no request to the host can name another); whatever the programs do to torch or to the process ends with it.
``dry_run`` is the check itself, as the child runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from opalctl.opal.agents.workspace import PROGRAM_FILES, read_program
from opalctl.opal.programs import ANALYSIS, UPDATER, ProgramRejected, check_program, load_program
from opalctl.opal.records import secret_names
from opalctl.opal.roles import role_of
from opalctl.sandbox import Bounds, confine_process, training_paths

DRY_RUN_SECONDS = 60.0  # one check's limit (and never past the decision's own)
STDERR_CHARS = 2000


def check_in_child(workspace: Path, facts: dict[str, Any], running: dict[str, str] | None,
                   seconds: float = DRY_RUN_SECONDS) -> str | None:
    """``dry_run`` in a child process without the secrets, stopped after ``seconds``: its error text, or None."""

    environment = {name: value for name, value in os.environ.items() if name not in secret_names(os.environ)}
    question = json.dumps({"workspace": str(workspace), "facts": facts, "running": running}).encode()
    child = subprocess.Popen([sys.executable, "-m", "opalctl.opal.agents.dry_run"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
    try:
        out, err = child.communicate(question, timeout=max(seconds, 0.1))
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return (f"the check ran past its limit of {seconds:g} s and was stopped: a program that never returns (a "
                f"loop at its top level, in build(), step() or analyze()) would stop the run the same way; make "
                f"every part return quickly")
    try:
        return json.loads(out)["problem"]
    except (ValueError, KeyError, TypeError):
        tail = err.decode(errors="replace").strip()[-STDERR_CHARS:]
        return f"the check's process ended with exit code {child.returncode} before it answered: {tail}"


def _confine_if_possible(workspace: Path) -> None:
    """No network, no writes, and nothing to read beyond what training reads and the workspace, for the programs
    on trial (where the kernel has Landlock): what they could read, they could print into the check's answer,
    which the agent reads. No process either, and no capability: a process the programs started would outlive
    the check's time limit, which kills this one."""

    confine_process(writable=[], readable=[*training_paths(), Path(workspace)], deny_network=True,
                    bounds=Bounds(no_processes=True, drop_capabilities=True))


def main() -> int:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # what the programs print goes to standard error
    question = json.loads(sys.stdin.read())
    import torch  # noqa: F401 - loaded before the confinement, as the training process loads it

    _confine_if_possible(Path(question["workspace"]))
    problem = dry_run(Path(question["workspace"]), question["facts"], question["running"])
    out.write(json.dumps({"problem": problem}))
    out.close()
    return 0


def _stand_ins(facts: dict[str, Any]):
    """name -> a parameter of the run's shape and dtype (random, from a private generator)."""
    import torch

    shapes = facts.get("shapes") or {"weight": [[8, 8], "float32"], "bias": [[8], "float32"]}
    generator = torch.Generator().manual_seed(0)
    params = {}
    for name, (shape, dtype_name) in shapes.items():
        dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            dtype = torch.float32
        value = torch.randn(tuple(shape), generator=generator) * 0.1
        params[name] = torch.nn.Parameter(value.to(dtype), requires_grad=dtype.is_floating_point)
    return params, generator


def dry_run(workspace: Path, facts: dict[str, Any], running: dict[str, str] | None = None) -> str | None:
    """The error text of the workspace's programs on stand-in tensors (None when they pass).

    The running programs (``running``, the files as the decision began) are built and stepped first, so that the
    new updater is built with a ``previous`` and an optimizer state, as it will be in the run. Torch's global
    random state is kept when this runs on the main thread (a program may draw from it).
    """
    import torch

    if threading.current_thread() is threading.main_thread():
        with torch.random.fork_rng(devices=[]):
            return _dry_run(workspace, facts, running)
    return _dry_run(workspace, facts, running)


def _dry_run(workspace: Path, facts: dict[str, Any], running: dict[str, str] | None) -> str | None:
    sources = {}
    for name in PROGRAM_FILES:
        if not os.path.lexists(Path(workspace) / name):
            return f"{name} is missing from the workspace; write it"
        sources[name], problem = read_program(Path(workspace), name)
        if problem is not None:
            return problem
    loaded = _loaded_programs(sources)
    if isinstance(loaded, str):
        return loaded
    build, analyze, every = loaded
    trial = _Trial(facts)
    stage = "building the running program"
    try:
        previous = trial.running_updater(running, sources[UPDATER])
        stage = "build()"
        updater = build(trial.params, previous, trial.spec)
        for method in ("step", "state_dict", "load_state_dict"):
            if not callable(getattr(updater, method, None)):
                return f"updater.py: the object build() returns has no {method}()"
        stage = "step()"
        before, problem = trial.step(updater)
        if problem is not None:
            return problem
        stage = "state_dict() / load_state_dict()"
        from opalctl.opal.plain import plain_problem

        state = updater.state_dict()
        problem = plain_problem(state)
        if problem is not None:  # what the run would revert the program for at its next checkpoint
            return f"updater.py: state_dict() returned a state that cannot be saved: {problem}"
        updater.load_state_dict(state)
        stage = "analyze()"
        return trial.analyse(analyze, every, updater, before)
    except Exception as error:
        lines = traceback.format_exc(limit=-4).rstrip()
        return f"{stage} raised {type(error).__name__}: {error}\n{lines}"


def _loaded_programs(sources: dict[str, str]):
    """``(build, analyze, EVERY)`` of the workspace's programs, or the text of why they do not load."""

    try:
        for name in ("updater", "analysis"):  # both refused before either's code runs, as in training
            check_program(name, sources[f"{name}.py"], label=name)
        updater_program = load_program("updater", sources[UPDATER], label="updater")
        analysis_program = load_program("analysis", sources[ANALYSIS], label="analysis")
    except ProgramRejected as error:
        return str(error)
    build = getattr(updater_program.module, "build", None)
    analyze = getattr(analysis_program.module, "analyze", None)
    if not callable(build):
        return "updater.py must define build(params, previous, spec)"
    if not callable(analyze):
        return "analysis.py must define analyze(obs, memory)"
    every = getattr(analysis_program.module, "EVERY", 25)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        return f"analysis.py: EVERY must be a positive integer, not {every!r}"
    return build, analyze, every


class _Trial:
    """The stand-ins a dry run works on: parameters of the run's shapes, a fresh AdamW, and where the run is."""

    def __init__(self, facts: dict[str, Any]):
        import torch

        from opalctl.opal.optimizer import GradView, Spec

        self.params, self.generator = _stand_ins(facts)
        lrs = facts.get("lrs") or [1e-3]
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=float(lrs[0] or 1e-3))
        self.spec = Spec(self.optimizer, None, None, facts.get("total_steps"), facts.get("goal"), self.params)
        self.grads = GradView(self.params)
        self.update = int(facts.get("update") or 0)
        self.progress = float(facts.get("progress") or 0.0)

    def random_grads(self) -> None:
        import torch

        for p in self.params.values():
            if p.requires_grad:
                p.grad = (torch.randn(tuple(p.shape), generator=self.generator) * 0.01).to(p.dtype)

    def _step(self, updater) -> None:
        import torch

        from opalctl.opal.optimizer import StepContext

        with torch.no_grad():
            updater.step(self.grads, self.update, StepContext(self.progress, torch.tensor(1.0), self.update))

    def running_updater(self, running: dict[str, str] | None, new_source: str):
        """The running program built and stepped once, so the new one is built with a ``previous`` and an optimizer
        state, as it will be in the run; None when there is none, it is the new one, or it fails (it is not on
        trial here)."""

        if not (running and running.get(UPDATER) and running[UPDATER] != new_source):
            return None
        try:
            old = load_program("updater", running[UPDATER], label="running-updater")
            previous = old.module.build(self.params, None, self.spec)
            self.random_grads()
            self._step(previous)
            return previous
        except Exception:
            return None

    def step(self, updater) -> tuple[dict[str, Any], str | None]:
        """One step on random gradients: the parameters before it, and what is wrong after it (None: nothing)."""
        import torch

        self.random_grads()
        before = {name: p.detach().clone() for name, p in self.params.items()}
        layout = {name: (p.dtype, tuple(p.shape)) for name, p in self.params.items()}
        self._step(updater)
        for name, p in self.params.items():
            if (p.dtype, tuple(p.shape)) != layout[name]:
                return before, (f"step() changed parameter {name} from {layout[name][0]} {list(layout[name][1])} to "
                                f"{p.dtype} {list(p.shape)}; keep dtype and shape")
            if not bool(torch.isfinite(p.detach()).all()):
                return before, f"step() left non-finite values in parameter {name}"
        return before, None

    def analyse(self, analyze, every: int, updater, before: dict[str, Any]) -> str | None:
        """One ``analyze()`` on what the run would observe; what is wrong with its result (None: nothing)."""
        import torch


        params, optimizer = self.params, self.optimizer
        obs = {"update": self.update + 1, "progress": self.progress, "losses": [2.0 - 0.01 * i for i in range(every)],
               "params": dict(params), "before": before, "grads": dict(self.grads.items()),
               "state": {name: optimizer.state.get(p, {}) for name, p in params.items()},
               "roles": {name: role_of(name, tuple(p.shape)) for name, p in params.items()},
               "lrs": [float(g["lr"]) for g in (getattr(updater, "param_groups", None) or optimizer.param_groups)]}
        memory: dict[str, Any] = {}
        with torch.no_grad():
            result = analyze(obs, memory)
        if not isinstance(result, dict):
            return f"analyze() returned {type(result).__name__}, not a dict"
        # the checks the run makes (observer.py): a report or memory that fails them reverts the program there
        from opalctl.opal.plain import json_text

        _, report_problem = json_text(result.get("report"), tensors="scalars")
        if report_problem is not None:
            return f"analyze() returned a report that cannot be written: {report_problem}"
        _, memory_problem = json_text(memory)
        if memory_problem is not None:
            return f"analyze(): the analysis memory cannot be saved: {memory_problem}"
        return None


if __name__ == "__main__":
    sys.exit(main())
