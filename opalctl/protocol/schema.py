"""The protocol's schema: what a person may write, with every default stated once: here, or for the keys a
backend reads (``arms.NAME.agent``), in that backend's options model (``opalctl.opal.agents.registry``).

Validation is done by pydantic (strict types, unknown keys forbidden), then by cross-field checks that need
the task (its splits and metrics) or torch (optimizer names and arguments). Every error becomes one sentence
naming the file, the line when the YAML parser knows it, the key path, and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from opalctl.driver.budget import CLOCKS
from opalctl.errors import BadInput
from opalctl.layout import NAME_PATTERN, name_problem
from opalctl.opal.agents import registry
from opalctl.opal.agents.anthropic import Prices
from opalctl.opal.agents.options import Strict
from opalctl.protocol.optimizers import check_optimizer, group_weight_decay_problem
from opalctl.protocol.yamlfile import load_yaml_with_lines
from opalctl.tasks import TaskLoadError, load_task_class

MAX_PATH = 1024  # characters of a data or parent path: room for any real project, far below what the OS refuses
MAX_BATCH = 1 << 16  # examples per update
MAX_SEED = (1 << 32) - 1  # every generator a run seeds (torch, numpy, the samplers) takes it
# the smallest and largest budget an arm may have (amount x budget_multiplier), by the clock's unit. Below the
# smallest, one update overshoots the budget by so many times that the stage and resume-checkpoint schedules,
# which count fractions of the budget, have millions of boundaries to walk; above the largest, nothing ends.
BUDGET_RANGE = {"seconds": (0.01, 1e8), "updates": (1, 1e9)}
SEALED_PARTS = ("sealed", "final-test", "evaluation-final")
DEFAULT_FRACTIONS = [0.25, 0.5, 0.75, 1.0]
ClockName = Literal[tuple(CLOCKS)]  # the registered budget clocks: adding one needs no change here


class TaskSpec(Strict):
    entry: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]
    config: dict[str, Any] = Field(default_factory=dict)


class Budget(Strict):
    clock: ClockName
    amount: Annotated[float, Field(gt=0)]  # its range and, on the updates clock, whole numbers: _check_budget
    threads: Annotated[int, Field(ge=1, le=256)] = 1
    fractions: list[Annotated[float, Field(gt=0, le=1)]] = Field(default_factory=lambda: list(DEFAULT_FRACTIONS))

    @field_validator("fractions")
    @classmethod
    def _fractions(cls, value: list[float]) -> list[float]:
        if not value:
            raise ValueError("list at least one fraction, the last being 1.0")
        if any(b <= a for a, b in zip(value, value[1:])):
            raise ValueError("fractions must increase strictly")
        if value[-1] != 1.0:
            raise ValueError("the last fraction must be 1.0 (the whole budget)")
        return value


class Training(Strict):
    batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH)]
    gradient_clip: Annotated[float, Field(gt=0)] | None = None
    # a resume checkpoint every this fraction of the budget (besides the stage checkpoints), so a crash loses
    # little; at most a thousand of them, each a file write
    checkpoint_every: Annotated[float, Field(ge=0.001, le=1)] = 0.1
    device: Literal["cpu", "cuda"] = "cpu"
    # the processes torchrun starts for every run of the lock, on one node (docs/integrations.md): every arm of a
    # comparison trains on the same world
    ranks: Annotated[int, Field(ge=1, le=64)] = 1


class OptimizerSpec(BaseModel):
    """``name`` is a class of ``torch.optim``; every other key is passed to it as a keyword argument."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    name: Annotated[str, Field(pattern=r"^[A-Za-z_]\w*$")]

    def arguments(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class AgentCommon(Strict):
    """The agent keys of every backend: which backend, when it is asked, and what the optimizer does with it."""

    backend: str = "heuristic"
    decisions: Annotated[int, Field(ge=1, le=1000)] | None = None
    schedule: Literal["front", "uniform"] | list[Annotated[float, Field(gt=0, lt=1)]] = "front"
    blocking: bool | Literal["auto"] = True
    max_lag: Annotated[int, Field(ge=0)] = 50
    every: Annotated[int, Field(ge=1)] = 25
    trial_steps: Annotated[int, Field(ge=1)] = 20
    prompt: Literal["neutral", "aggressive"] = "neutral"
    goal: str | None = None
    max_cost_usd: Annotated[float, Field(gt=0)] | None = None
    # whether a person may leave notes for the agent while it trains (`opalctl say`; opal/notes.py): absent, none
    # (and a lock without the key is as it always was: opalctl/protocol/freeze.py leaves it out)
    notes: Literal["allowed"] | None = None
    # seconds one call of the agent's program (a step, build(), ...) may take before it is interrupted and counts as
    # a failure (opal/guard.py); absent, the agent optimizer's 10 s, and a lock without the key is as it always was
    step_time_limit: Annotated[float, Field(gt=0, le=3600)] | None = None

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str | list[float]) -> str | list[float]:
        if isinstance(value, list) and any(b <= a for a, b in zip(value, value[1:])):
            raise ValueError("list the decision fractions in increasing order, each once")
        return value

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if registry.find(value) is not None:
            return value
        raise ValueError(f"unknown backend {value!r}; use one of {registry.spellings()}")


class AgentSpec(*registry.option_models(), AgentCommon):
    """``arms.NAME.agent``: the common keys and those of every backend (each backend reads its own; a protocol
    may name any of them whatever its backend, as it always could), with each default where its backend states it."""


WSD_ONLY = ("decay", "decay_shape")


class ScheduleSpec(Strict):
    """``arms.NAME.schedule`` written as a mapping, for the recipes a name alone cannot say: a linear warm-up over
    the first ``warmup`` of the arm's budget, then the named schedule over the rest, falling to ``min_lr`` (a ratio
    of the peak learning rate) rather than to zero; ``wsd`` (warm-up, stable, decay) holds the peak and decays over
    the last ``decay`` of the budget after the warm-up, with the shape ``decay_shape``. The factor at each budget
    fraction is ``opalctl.driver.arm.Schedule.factor``."""

    name: Literal["constant", "cosine", "linear", "anneal-end", "wsd"]
    warmup: Annotated[float, Field(ge=0, lt=1)] = 0.0
    min_lr: Annotated[float, Field(ge=0, lt=1)] = 0.0
    decay: Annotated[float, Field(gt=0, le=1)] = 0.2
    decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"

    @model_validator(mode="after")
    def _meaningful(self) -> ScheduleSpec:
        # (a lock resolves every key, so a wsd key at its default is what any other schedule's lock holds)
        if self.name != "wsd" and (given := [key for key in WSD_ONLY
                                             if getattr(self, key) != type(self).model_fields[key].default]):
            raise ValueError(f"{' and '.join(given)} belong{'s' if len(given) == 1 else ''} to the wsd schedule; "
                             f"remove {'it' if len(given) == 1 else 'them'} or write name: wsd")
        if self.name == "constant" and self.min_lr:
            raise ValueError("a constant schedule never falls, so min_lr has nothing to floor; remove it")
        return self


GROUP_RULES = ("bias", "norm", "ndim<2")  # what each selects: opalctl.driver.groups
# a name pattern: the characters of a parameter's qualified name (``block.0.norm1.weight``) and fnmatch's
NAME_PATTERN_CHARS = re.compile(r"^[\w.*?\[\]!-]+$")


def _selector(value: str) -> str:
    if value in GROUP_RULES or NAME_PATTERN_CHARS.fullmatch(value):
        return value
    raise ValueError(f"{value!r} is neither a rule ({', '.join(GROUP_RULES)}) nor a pattern of parameter names "
                     f"(such as 'head.*' or '*.embed*')")


class GroupSpec(Strict):
    """One of ``arms.NAME.groups``: the parameters it takes (``match``: rules and name patterns, any of which
    selects a parameter; a parameter an earlier group took stays there) and what they get instead of the
    optimizer's own settings: their own ``weight_decay``, and ``lr_scale`` times the optimizer's learning rate
    (so the schedule, and an agent's scaling, move every group's learning rate by the same factor)."""

    match: Annotated[list[Annotated[str, AfterValidator(_selector)]], Field(min_length=1, max_length=64)]
    weight_decay: Annotated[float, Field(ge=0)] | None = None  # None: the optimizer's
    lr_scale: Annotated[float, Field(gt=0, le=1000)] = 1.0

    @model_validator(mode="after")
    def _changes_something(self) -> GroupSpec:
        if self.weight_decay is None and self.lr_scale == 1.0:
            raise ValueError("this group sets neither weight_decay nor lr_scale, so its parameters would train as "
                             "the rest do; give one, or remove the group")
        return self


class Arm(Strict):
    optimizer: OptimizerSpec
    # a name (as every protocol before warm-up and floors wrote it, and resolves as it always did) or a mapping
    # (the tags name the two forms; an error's key path leaves them out, as it does every tag with a "[")
    schedule: Annotated[Annotated[Literal["constant", "cosine", "linear", "anneal-end", "wsd"], Tag("[name]")]
                        | Annotated[ScheduleSpec, Tag("[mapping]")],
                        Discriminator(lambda value: "[mapping]" if isinstance(value, dict | ScheduleSpec) else "[name]")] \
        = "constant"
    budget_multiplier: Annotated[float, Field(gt=0, le=100)] = 1.0
    model: dict[str, Any] = Field(default_factory=dict)  # task-specific settings handed to Task.build
    agent: AgentSpec | None = None
    # parameter groups with their own weight decay and learning-rate multiplier (GroupSpec); None, as every protocol
    # before groups, resolves without the key, so no lock's digest moves
    groups: Annotated[list[GroupSpec], Field(min_length=1, max_length=64)] | None = None


class Selection(Strict):
    denominators: list[str] = Field(default_factory=list)
    floors: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    nondecreasing: list[str] = Field(default_factory=list)
    nonincreasing: list[str] = Field(default_factory=list)
    improve_any: list[str] = Field(default_factory=list)

    def metric_keys(self) -> list[tuple[str, str]]:
        out = [("denominators", m) for m in self.denominators] + [("floors", m) for m in self.floors]
        for rule in ("nondecreasing", "nonincreasing", "improve_any"):
            out += [(rule, m) for m in getattr(self, rule)]
        return out


MEMORY_FLOOR_BYTES = 512 << 20  # limits.memory_bytes at the least


class Limits(Strict):
    """``limits``: what a run may load, and what the confined training process of an agent arm may use
    (opalctl/sandbox.py, opalctl/training_folder.py). ``auto`` is a rule, evaluated when a run starts; the value it
    gave is recorded in the run's ``confinement.bounds``."""

    checkpoint_bytes: Annotated[int, Field(ge=1024)] = 2 << 30  # also one file's bound (at least 1 GiB)
    # RLIMIT_DATA; auto: three quarters of the machine's (or its cgroup's) memory, shared by the ranks
    memory_bytes: int | Literal["auto"] = "auto"
    # checked by the evaluator at every stage; auto: a checkpoint per stage, the resume checkpoint and one being
    # written, each within checkpoint_bytes, and 1 GiB for the steps and the agent optimizer's records
    training_folder_bytes: int | Literal["auto"] = "auto"
    # the seconds one call of the task's evaluate (one split) may take in the evaluator; past it the evaluator ends
    # the run in one sentence (driver/evaluation.py)
    evaluate_seconds: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] = 3600.0

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        return _bytes_or_auto(value, MEMORY_FLOOR_BYTES, "512 MiB: torch alone takes some 220 MB")

    @field_validator("training_folder_bytes", mode="before")
    @classmethod
    def _folder(cls, value: Any) -> Any:
        return _bytes_or_auto(value, 1 << 20, "1 MiB")


def _bytes_or_auto(value: Any, floor: int, floor_text: str) -> Any:
    if value == "auto" or (type(value) is int and value >= floor):
        return value
    raise ValueError(f"give a number of bytes, at least {floor} ({floor_text}), or auto (got {value!r})")


def _plain_name(value: str) -> str:
    """A lock's or an arm's name: one that can be a folder of the runs folder (``layout.name_problem``)."""
    if problem := name_problem(value):
        raise ValueError(f"{value!r} {problem}")
    return value


PlainName = Annotated[str, Field(pattern=NAME_PATTERN), AfterValidator(_plain_name)]


class Control(Strict):
    """``control``: this protocol is a control added after the fact (``opalctl control``), not pre-registered. It
    names its parent lock (relative to this file's folder) and that lock's sha256, the agent arm it controls and the
    run whose decisions it replays; ``verify`` and ``run`` refuse it unless the parent is that very lock and every
    arm gets the parent arm's compute (opalctl/protocol/control.py)."""

    post_hoc: Literal[True]
    parent_lock: str
    parent_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    arm: str
    from_seed: Annotated[int, Field(ge=0, le=MAX_SEED)]
    source_run: str


class Target(Strict):
    """``target``: the value of one evaluation metric that counts as trained, fixed before any run, as AlgoPerf fixes
    each workload's target. A run reaches it at the first stage whose candidate (that stage's checkpoint, whatever
    promotion decides) has ``metric`` >= ``value`` for a metric of kind "higher", <= for "lower"; its time-to-target
    is the budget charged by then (opalctl/compare/target.py). A "count" metric (a denominator, the same for every
    model) is refused: it says nothing about training."""

    metric: Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}\.[A-Za-z_][\w-]*$")]
    value: float


class Protocol(Strict):
    name: PlainName
    task: TaskSpec
    data: dict[Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")], str]
    parents: str | dict[int, str]
    seeds: Annotated[list[Annotated[int, Field(ge=0, le=MAX_SEED)]], Field(min_length=1, max_length=1000)]
    budget: Budget
    training: Training
    arms: Annotated[dict[PlainName, Arm], Field(min_length=1)]
    selection: Selection = Field(default_factory=Selection)
    limits: Limits = Field(default_factory=Limits)
    control: Control | None = None  # only in a control lock's protocol (opalctl control)
    target: Target | None = None  # absent: no time-to-target, and the lock is as it always was

    @field_validator("seeds")
    @classmethod
    def _unique(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("each seed may appear once")
        return value

    @field_validator("data")
    @classmethod
    def _train(cls, value: dict[str, str]) -> dict[str, str]:
        if "train" not in value:
            raise ValueError("name the training rows as data.train")
        return value

    def parent_for(self, seed: int) -> str:
        if isinstance(self.parents, str):
            return self.parents.replace("{seed}", str(seed))
        return self.parents[seed]


# --------------------------------------------------------------------------------------------------------------
# turning errors into sentences

def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        if isinstance(part, str) and not re.fullmatch(r"[\w.{}-]*", part):
            part = repr(part)
        out += f"[{part}]" if isinstance(part, int) and out else (f".{part}" if out else str(part))
    return out or "(top level)"


def _data_path(data: Any, loc: tuple) -> tuple:
    """The part of a pydantic error location that walks the real document (drops union tags and the like)."""
    path: list = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, str) and part.isdigit() and int(part) in node:
            path.append(int(part))
            node = node[int(part)]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        elif isinstance(node, dict) and "[key]" not in str(part) and not path_is_tag(part):
            path.append(part)  # a missing key: name it, it is not in the document
            break
        else:
            continue
    return tuple(path)


def path_is_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "bool", "float", "list", "dict") or "[" in part
                                      or part.startswith("literal") or part.startswith("function"))


def _line_of(lines: dict[tuple, int], path: tuple) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


class ProtocolError(BadInput):
    """Every problem of one protocol file, as ``(key, line, text)`` in ``problems``. The sentence names the first
    and counts the others: a refused protocol is one line on stderr, so a person fixes one problem at a time."""

    def __init__(self, where: str, problems: list[tuple[str, int | None, str]]):
        self.problems = problems
        key, line, text = problems[0]
        place = f"{where} line {line}" if line else where
        more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        super().__init__(f"{place}: {key}: {text}{more}")


def _message(error: dict, known: list[str] | None) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        hint = f" (known keys: {', '.join(known)})" if known else ""
        return f"unknown key; check its spelling{hint}"
    if kind == "missing":
        return "this key is required"
    text = error["msg"]
    text = re.sub(r"^(Value error|Assertion failed), ", "", text)
    got = error.get("input")
    if kind.endswith("_type") or kind.startswith("literal") or kind.startswith("string_pattern"):
        shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
        if len(shown) > 60:
            shown = shown[:57] + "..."
        text = f"{text[0].lower()}{text[1:]} (got {shown})"
    return text[0].lower() + text[1:] if text else "invalid value"


def parse(data: dict, lines: dict[tuple, int], where: str) -> Protocol:
    try:
        return Protocol.model_validate(data)
    except ValidationError as error:
        problems = []
        # a misspelt key usually also leaves a required key missing: name the misspelling first
        ordered = sorted(error.errors(), key=lambda item: item["type"] != "extra_forbidden")
        for item in ordered:
            path = _data_path(data, tuple(item["loc"]))
            known = None
            if item["type"] == "extra_forbidden":
                known = _known_keys_for(path)
            problems.append((_dotted(path), _line_of(lines, path), _message(item, known)))
        # a union produces one error per alternative at the same key: keep the first of each key
        unique, seen = [], set()
        for problem in problems:
            if problem[0] not in seen:
                unique.append(problem)
                seen.add(problem[0])
        raise ProtocolError(where, unique) from None


def _known_keys_for(path: tuple) -> list[str] | None:
    table: dict[tuple, type[BaseModel]] = {
        (): Protocol, ("task",): TaskSpec, ("budget",): Budget, ("training",): Training,
        ("selection",): Selection, ("limits",): Limits, ("target",): Target,
    }
    parent = path[:-1]
    if parent in table:
        return sorted(table[parent].model_fields)
    if len(parent) == 2 and parent[0] == "arms":
        return sorted(Arm.model_fields)
    if len(parent) == 4 and parent[0] == "arms" and parent[2] == "groups":
        return sorted(GroupSpec.model_fields)
    if len(parent) == 3 and parent[0] == "arms" and parent[2] == "agent":
        return sorted(AgentSpec.model_fields)
    if len(parent) == 4 and parent[0] == "arms" and parent[2] == "agent" and parent[3] == "prices":
        return sorted(Prices.model_fields)
    return None


# --------------------------------------------------------------------------------------------------------------
# checks that need more than the schema

def sealed_part(path: str) -> str | None:
    parts = re.split(r"[\\/]", path.lower())
    for part in parts:
        stem = part.split(".")[0]
        for sealed in SEALED_PARTS:
            if sealed in (part, stem) or part.startswith(sealed):
                return sealed
    return None


def resolved_sealed(folder: Path, relative: str) -> str | None:
    """The sealed part of where ``relative`` leads from ``folder`` once every symbolic link is followed: a link
    named ``data/ret.npz`` into ``sealed/`` is as sealed as the text ``sealed/ret.npz``. Only the part of the
    resolved path below what it shares with the folder is read, as the text of a relative path is, so a project
    that happens to live under a folder named ``sealed`` is not refused for where it lives."""
    base = os.path.realpath(folder)
    target = os.path.realpath(os.path.join(base, relative))
    common = os.path.commonpath([base, target])
    return sealed_part(os.path.relpath(target, common))


def path_problem(relative: str) -> str | None:
    """What makes ``relative`` unusable as a path whatever the disk holds, or None."""
    if not relative.strip():
        return "the path is empty; give the file's path relative to the protocol's folder"
    if "\0" in relative:
        return "the path holds a NUL character; give the file's path relative to the protocol's folder"
    if len(relative) > MAX_PATH:
        return f"the path is {len(relative)} characters long, over {MAX_PATH}; give a shorter path"
    if any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in re.split(r"[\\/]", relative)):
        return "a part of the path is over 255 bytes, which no file system allows; give a shorter name"
    return None


def validate(protocol: Protocol, lines: dict[tuple, int], where: str, folder: Path) -> None:
    """Cross-field checks: sealed paths (as written and as they resolve from ``folder``), parents for every seed,
    the budget each arm gets, the task's config, splits and metrics, optimizers. Freeze calls it, and so do run
    and verify on a lock's protocol (with the lock's folder), so what freeze refuses is refused there too."""
    problems: list[tuple[str, int | None, str]] = []

    def problem(path: tuple, text: str) -> None:
        problems.append((_dotted(path), _line_of(lines, path), text))

    _check_paths(protocol, Path(folder), problem)
    _check_budget(protocol, problem)
    try:
        task_cls = load_task_class(protocol.task.entry)
    except TaskLoadError as error:
        # said at once: the optimizer checks below import torch (seconds), and nothing can run without the task
        problem(("task", "entry"), str(error))
        raise ProtocolError(where, problems) from None
    _check_task(protocol, task_cls, problem)
    for arm_name, arm in protocol.arms.items():
        if reason := check_optimizer(arm.optimizer.name, arm.optimizer.arguments(), protocol.training.device):
            problem(("arms", arm_name, "optimizer", "name"), reason)
        for index, group in enumerate(arm.groups or []):
            if group.weight_decay is not None and (reason := group_weight_decay_problem(arm.optimizer.name)):
                problem(("arms", arm_name, "groups", index, "weight_decay"), reason)
        if arm.agent is not None:
            for key, text in registry.problems(arm.agent, f"arms.{arm_name}.agent"):
                problem(("arms", arm_name, "agent", key), text)
    if problems:
        raise ProtocolError(where, problems)


def _check_budget(protocol: Protocol, problem) -> None:
    """The budget and each arm's share of it within ``BUDGET_RANGE``, and whole on a clock that counts updates:
    the run's meter gets exactly ``amount * budget_multiplier``, so that very product is what is checked."""
    budget = protocol.budget
    unit = CLOCKS[budget.clock].unit
    low, high = BUDGET_RANGE[unit]
    whole = unit == "updates"
    if not low <= budget.amount <= high:
        problem(("budget", "amount"), f"a {budget.clock} budget lies between {low:g} and {high:g} {unit}, not "
                                      f"{budget.amount:g}; give an amount in that range")
        return
    if whole and budget.amount != int(budget.amount):
        problem(("budget", "amount"), "an `updates` budget counts whole updates; give an integer amount")
        return
    for arm_name, arm in protocol.arms.items():
        total = budget.amount * arm.budget_multiplier
        if not low <= total <= high:
            problem(("arms", arm_name, "budget_multiplier"),
                    f"gives this arm {total:g} {unit} (amount {budget.amount:g} x {arm.budget_multiplier:g}), outside "
                    f"{low:g} to {high:g}; choose a multiplier that stays in that range")
        elif whole and total != int(total):
            problem(("arms", arm_name, "budget_multiplier"),
                    f"leaves this arm {total!r} updates (amount {budget.amount:g} x {arm.budget_multiplier:g}); an "
                    f"`updates` budget counts whole updates, so choose a multiplier that gives a whole number")


def _check_paths(protocol: Protocol, folder: Path, problem) -> None:
    """Every split and parent a usable path that names no sealed data, neither as written nor where it resolves
    from ``folder``; a dict of parents names one for every seed."""
    for split, value in protocol.data.items():
        if reason := _path_refusal(folder, value, "opalctl never reads a final test set, so remove this split "
                                                  "from the protocol"):
            problem(("data", split), reason)
    if isinstance(protocol.parents, dict):
        for seed in protocol.seeds:
            if seed not in protocol.parents:
                problem(("parents",), f"no parent for seed {seed}; add it or use a template with {{seed}}")
    # (one parent shared by every seed is allowed)
    for seed in protocol.seeds:
        if isinstance(protocol.parents, dict) and seed not in protocol.parents:
            continue
        if reason := _path_refusal(folder, protocol.parent_for(seed), "a parent must not live there"):
            problem(("parents",), reason)
            break


def _path_refusal(folder: Path, relative: str, advice: str) -> str | None:
    if reason := path_problem(relative):
        return reason
    if sealed := sealed_part(relative):
        return f"the path names sealed data ({sealed!r}); {advice}"
    if sealed := resolved_sealed(folder, relative):
        return f"the path leads (through a symbolic link) to sealed data ({sealed!r}); {advice}"
    return None


def _check_task(protocol: Protocol, task_cls, problem) -> None:
    """The task's config and each arm's model settings as the task defines them, its splits and its metrics."""
    try:
        task_cls.Config.model_validate(protocol.task.config)
    except ValidationError as error:
        for item in error.errors():
            path = ("task", "config") + _data_path(protocol.task.config, tuple(item["loc"]))
            known = sorted(task_cls.Config.model_fields) if item["type"] == "extra_forbidden" else None
            problem(path, _message(item, known))
    for arm_name, arm in protocol.arms.items():
        try:
            task_cls.ArmConfig.model_validate(arm.model)
        except ValidationError as error:
            for item in error.errors():
                path = ("arms", arm_name, "model") + _data_path(arm.model, tuple(item["loc"]))
                known = sorted(task_cls.ArmConfig.model_fields) if item["type"] == "extra_forbidden" else None
                text = (f"task {task_cls.name!r} takes no arm model settings; remove this key" if known == []
                        else _message(item, known))
                problem(path, text)
    for split in task_cls.splits:
        if split not in protocol.data:
            problem(("data",), f"task {task_cls.name!r} needs a data.{split} file")
    evaluation_splits = [s for s in protocol.data if s != "train"]
    for rule, metric in protocol.selection.metric_keys():
        split, _, name = metric.partition(".")
        index_path = ("selection", rule)
        if split not in evaluation_splits:
            problem(index_path, f"{metric!r} names no evaluation split (use one of "
                                f"{', '.join(evaluation_splits) or 'none'} then a metric, e.g. "
                                f"{(evaluation_splits or ['selection'])[0]}.correct)")
        elif name not in task_cls.metrics:
            problem(index_path, f"{metric!r}: task {task_cls.name!r} reports no metric {name!r} (it reports "
                                f"{', '.join(sorted(task_cls.metrics))})")
    if protocol.target is not None:
        _check_target(protocol.target, evaluation_splits, task_cls, problem)


def _check_target(target: Target, evaluation_splits: list[str], task_cls, problem) -> None:
    """The target's metric: an evaluation split's metric the task reports, of kind "higher" or "lower"."""
    split, _, name = target.metric.partition(".")
    path = ("target", "metric")
    if split not in evaluation_splits:
        problem(path, f"{target.metric!r} names no evaluation split (use one of {', '.join(evaluation_splits) or 'none'} "
                      f"then a metric, e.g. {(evaluation_splits or ['selection'])[0]}.correct)")
    elif name not in task_cls.metrics:
        problem(path, f"{target.metric!r}: task {task_cls.name!r} reports no metric {name!r} (it reports "
                      f"{', '.join(sorted(task_cls.metrics))})")
    elif task_cls.metrics[name] not in ("higher", "lower"):
        problem(path, f"{target.metric!r} is a count (the same for every model), which no training reaches; name a "
                      f"metric where higher or lower is better")


def load_protocol(path: Path) -> Protocol:
    """Read, validate and cross-check a protocol file; raises BadInput with one sentence on any problem."""
    data, lines = load_yaml_with_lines(path)
    protocol = parse(data, lines, str(path))
    validate(protocol, lines, str(path), path.parent)
    return protocol
