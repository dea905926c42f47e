"""The suite file: what a person may write in ``SUITE.yaml``, with the protocol's strictness and its sentences.

    name: core                 # the suite's name; each task's protocol is named NAME-TASK
    seeds: [1, 2, 3]           # every task's seeds (a task may override them)
    baseline: adamw            # the arm every other is paired against, on every task
    arms: {ARM: {...}, ...}    # arms as a protocol writes them, the same on every task
    tasks:
      TASK:
        builtin: digits        # a built-in task (`opalctl init digits` makes its data and parents), or
        protocol: my.yaml      # a protocol file (relative to the suite file); its arms and seeds are the suite's
        budget: {...}          # the task's budget rule, key by key over the protocol's (clock, amount, ...)
        target: {metric: SPLIT.METRIC, value: NUMBER}   # required unless the protocol has one
        config: {...}          # task settings over the protocol's task.config (a built-in's data is made with them)
        arms: {ARM: {...}}     # this task's settings of some of the suite's arms, each replacing the arm whole
        overrides: {...}       # any other top-level protocol key (training, selection, limits), replacing it

A task's ``arms`` is how an arm is tuned per task, as AlgoPerf's external tuning tunes a submission's settings per
workload: it may only name arms of the suite (every task runs the same arms, so the profiles compare like with
like), the suite lock keeps it, and ``summary`` names every arm whose settings differ by task.

Every arm must be valid where it runs: the arms are checked here by the protocol's own schema (so an error names
the suite's line), and each task's protocol is checked whole when it is frozen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, model_validator

from opalctl.opal.agents.options import Strict
from opalctl.protocol.schema import (
    MAX_SEED,
    Arm,
    PlainName,
    ProtocolError,
    Target,
    _data_path,
    _dotted,
    _line_of,
    _message,
)
from opalctl.protocol.yamlfile import load_yaml_with_lines

# top-level protocol keys a task may override whole (``overrides``); the others are the suite's or have their key
OVERRIDABLE = ("training", "selection", "limits")


class SuiteTask(Strict):
    builtin: str | None = None
    protocol: str | None = None
    budget: dict[str, Any] = Field(default_factory=dict)
    target: Target | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    arms: dict[PlainName, Arm] = Field(default_factory=dict)
    seeds: Annotated[list[Annotated[int, Field(ge=0, le=MAX_SEED)]], Field(min_length=1, max_length=1000)] | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> SuiteTask:
        if (self.builtin is None) == (self.protocol is None):
            raise ValueError("give either builtin (a built-in task's name) or protocol (a protocol file), not "
                             f"{'both' if self.builtin else 'neither'}")
        if unknown := sorted(set(self.overrides) - set(OVERRIDABLE)):
            raise ValueError(f"overrides may replace {', '.join(OVERRIDABLE)}, not {', '.join(unknown)} (budget, "
                             f"target, config, seeds and arms have keys of their own; name is the suite's)")
        return self


class Suite(Strict):
    name: PlainName
    seeds: Annotated[list[Annotated[int, Field(ge=0, le=MAX_SEED)]], Field(min_length=1, max_length=1000)]
    baseline: str
    arms: Annotated[dict[PlainName, Arm], Field(min_length=1)]
    tasks: Annotated[dict[PlainName, SuiteTask], Field(min_length=1)]

    @model_validator(mode="after")
    def _baseline(self) -> Suite:
        if self.baseline not in self.arms:
            raise ValueError(f"baseline {self.baseline!r} is not an arm of the suite ({', '.join(self.arms)})")
        for task, spec in self.tasks.items():
            if unknown := [arm for arm in spec.arms if arm not in self.arms]:
                raise ValueError(f"tasks.{task}.arms names {unknown[0]!r}, not an arm of the suite "
                                 f"({', '.join(self.arms)}); a task may set its own settings of the suite's arms, "
                                 f"not add arms (every task runs the same arms)")
        for seeds in [self.seeds] + [t.seeds for t in self.tasks.values() if t.seeds]:
            if len(set(seeds)) != len(seeds):
                raise ValueError("each seed may appear once")
        return self

    def seeds_of(self, task: str) -> list[int]:
        return list(self.tasks[task].seeds or self.seeds)

    def tuned_per_task(self) -> dict[str, list[str]]:
        """Each arm whose settings some task replaces, with those tasks (in the suite's order)."""
        return tuned_per_task(self.tasks)

    def protocol_name(self, task: str) -> str:
        return f"{self.name}-{task}"


def tuned_per_task(tasks: dict[str, Any]) -> dict[str, list[str]]:
    """Each arm some task sets its own settings of, with those tasks: from the checked suite's tasks, or from the
    suite as written (a suite lock keeps it), where a task is a mapping."""
    out: dict[str, list[str]] = {}
    for task, spec in tasks.items():
        arms = spec.arms if isinstance(spec, SuiteTask) else (spec.get("arms") or {})
        for arm in arms:
            out.setdefault(arm, []).append(task)
    return out


def load_suite(path: Path) -> tuple[Suite, dict[str, Any]]:
    """The suite file read and checked (``ProtocolError``, one sentence naming the file, line and key), with the
    document as written (the arms are written into each task's protocol as the person wrote them)."""
    data, lines = load_yaml_with_lines(path)
    where = str(path)
    if not isinstance(data, dict):
        raise ProtocolError(where, [("(top level)", None, "a suite file is a mapping with name, seeds, baseline, "
                                                          "arms and tasks; see docs/suite.md")])
    try:
        suite = Suite.model_validate(data)
    except ValidationError as error:
        problems = []
        for item in sorted(error.errors(), key=lambda item: item["type"] != "extra_forbidden"):
            path_in = _data_path(data, tuple(item["loc"]))
            known = sorted(_known(path_in)) if item["type"] == "extra_forbidden" else None
            problems.append((_dotted(path_in), _line_of(lines, path_in), _message(item, known)))
        unique, seen = [], set()
        for problem in problems:  # a union gives one error per alternative at the same key: the first of each
            if problem[0] not in seen:
                unique.append(problem)
                seen.add(problem[0])
        raise ProtocolError(where, unique) from None
    return suite, data


def _known(path: tuple) -> list[str]:
    parent = path[:-1]
    if parent == ():
        return list(Suite.model_fields)
    if len(parent) == 2 and parent[0] == "tasks":
        return list(SuiteTask.model_fields)
    if (len(parent) == 2 and parent[0] == "arms") or (len(parent) == 4 and parent[0] == "tasks"
                                                      and parent[2] == "arms"):
        return list(Arm.model_fields)
    return []
