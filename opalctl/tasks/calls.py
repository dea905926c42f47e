"""The user's task as opalctl calls it: every call into it is the task's, and its failure is one sentence.

``make_task`` hands out a ``CalledTask``, which holds the task and calls each method for the driver: an exception in
``load``, ``build``, ``sampler``, ``loss`` or ``evaluate`` (or in the sampler's ``next_batch``, ``state_dict`` or
``load_state_dict``) becomes a ``TaskFailed`` naming the task's entry, the method and the exception, never an
internal error of opalctl. What the task returns is checked where opalctl depends on it:

- ``loss``: a pair (a scalar tensor that requires a gradient, a dict); anything else is a sentence;
- ``evaluate``: a dict of numbers (``checked_metrics``): numpy and 0-dim torch numbers are converted to Python's;
  a "count" must be a whole number; a "higher" or "lower" metric may be non-finite (a diverged model's loss is a
  result: the record holds null and the promotion rules it touches fail); a bool, a string, None, or an integer
  too large for a float to hold exactly (``10**400``) is refused;
- the sampler's ``state_dict``: plain data a resume checkpoint can hold (``check_plain``), checked every time a
  resume checkpoint is written, the first at update 0, so a task that would leave an unreadable checkpoint fails
  before it trains.

An ``OpalctlError`` the task raises itself (a parent refused by ``checkpoints.load``, a state it refuses) is its
own sentence and passes unchanged, and so do a ``MemoryError`` (the confinement's memory bound says it,
``sandbox.bound_refusal``) and a stop signal's ``KeyboardInterrupt``.
"""

from __future__ import annotations

import collections
import math
import numbers
from typing import Any

from opalctl.errors import OpalctlError

# the largest integer a float (and every JSON reader) holds exactly; a metric beyond it is refused
EXACT_INTEGER = 2 ** 53
PLAIN_SCALARS = (str, int, float, bool, type(None))


class TaskFailed(OpalctlError):
    """The user's task failed in one of its methods, or returned what opalctl cannot use (exit 1). A run ends its
    sentence with the command that continues it (``for_command``), for a cause that passes (a file, the memory)."""

    def for_command(self, command: str) -> TaskFailed:
        return TaskFailed(f"{self.message}; if the cause has passed, `{command}` continues the run",
                          details=self.details)


def task_failed(entry: str, method: str, error: BaseException) -> TaskFailed:
    text = " ".join(str(error).split())[:200]
    return TaskFailed(f"task {entry} failed in {method}: {type(error).__name__}{': ' + text if text else ''}; "
                      f"fix the task (a changed task is a new lock: freeze it again)")


def refused(entry: str, method: str, what: str) -> TaskFailed:
    return TaskFailed(f"task {entry}'s {method} {what}; fix the task (a changed task is a new lock: freeze it "
                      f"again)")


def _passes(error: BaseException) -> bool:
    """Errors that are not the task's failure to report: opalctl's own sentences and the memory bound."""
    return isinstance(error, (OpalctlError, MemoryError))


def call_into(entry: str, method: str, function, *args):
    """``function(*args)``, a call into the task ``entry``: its exception becomes ``TaskFailed`` naming ``method``
    (one that must pass through, such as a stop, passes)."""
    try:
        return function(*args)
    except Exception as error:
        if _passes(error):
            raise
        raise task_failed(entry, method, error) from error


class CalledTask:
    """A task, every call into it checked (module docstring). Its attributes (``metrics``, ``splits``, ``name``,
    ``config``, ...) are the task's."""

    def __init__(self, task, entry: str):
        self.task = task
        self.entry = entry

    def __getattr__(self, name: str) -> Any:
        if name == "task":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)

    def _call(self, method: str, *args):
        return call_into(self.entry, method, getattr(self.task, method), *args)

    def load(self, data_paths):
        splits = self._call("load", data_paths)
        if not isinstance(splits, dict):
            raise refused(self.entry, "load", f"returned {type(splits).__name__}, not a dict of splits")
        missing = [split for split in data_paths if split not in splits]
        if missing:
            raise refused(self.entry, "load", f"returned no split {', '.join(map(repr, missing))}")
        return splits

    def build(self, parent_path, arm_config, seed: int, device: str = "cpu"):
        from opalctl.tasks.base import Built

        built = self._call("build", parent_path, arm_config, seed, device)
        if not isinstance(built, Built):
            raise refused(self.entry, "build", f"returned {type(built).__name__}, not an opalctl.tasks.base.Built")
        if not hasattr(built.model, "state_dict") or not hasattr(built.model, "parameters"):
            raise refused(self.entry, "build", f"built a {type(built.model).__name__}, not a torch module")
        return built

    def sampler(self, train, seed: int, batch_size: int, device: str = "cpu") -> CalledSampler:
        return CalledSampler(self._call("sampler", train, seed, batch_size, device), self.entry)

    def prepare(self, folder, seeds):
        return self._call("prepare", folder, seeds)

    def loss(self, model, batch):
        """The hot path: called once per update, so it checks with a few attribute reads."""
        try:
            loss, details = self.task.loss(model, batch)
        except Exception as error:
            if _passes(error):
                raise
            raise task_failed(self.entry, "loss", error) from error
        if getattr(loss, "ndim", None) != 0 or not getattr(loss, "requires_grad", False):
            raise refused(self.entry, "loss", _not_a_loss(loss))
        return loss, details

    def evaluate(self, model, rows) -> dict[str, float | int]:
        return checked_metrics(self.entry, self.task.metrics, self._call("evaluate", model, rows))


def _not_a_loss(loss: Any) -> str:
    shape = getattr(loss, "shape", None)
    if shape is None or not hasattr(loss, "backward"):
        return f"returned a {type(loss).__name__} as the loss, not a scalar tensor"
    if len(shape) != 0:
        return (f"returned a loss of shape {tuple(shape)}, not a scalar (0-dimensional) tensor; reduce it, with its "
                f"mean for instance")
    return ("returned a loss that requires no gradient (computed without the model's parameters, or under "
            "torch.no_grad), so no update can follow from it")


class CalledSampler:
    """The task's sampler, each call checked; ``fresh_ids`` and any other attribute are the sampler's."""

    def __init__(self, sampler, entry: str):
        self.sampler = sampler
        self.entry = entry
        self.fresh_ids = bool(getattr(sampler, "fresh_ids", False))

    def __getattr__(self, name: str) -> Any:
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def _call(self, method: str, *args):
        return call_into(self.entry, f"sampler's {method}", getattr(self.sampler, method), *args)

    def next_batch(self):
        return self._call("next_batch")

    def state_dict(self) -> dict:
        state = self._call("state_dict")
        problem = check_plain(state, "state")
        if problem:
            raise refused(self.entry, "sampler's state_dict", f"returned {problem}, which a resume checkpoint "
                          f"cannot hold; return plain data (dict with str keys, list, str, int, float, bool, None, "
                          f"torch tensors): int(...) or float(...) turns a numpy number into one")
        return state

    def load_state_dict(self, state) -> None:
        self._call("load_state_dict", state)


def check_plain(value: Any, where: str, depth: int = 0) -> str:
    """"" when ``value`` is data a checkpoint loads with ``weights_only`` (and a person can read): dicts with str
    keys, lists, tuples, plain scalars, torch tensors; else what and where the first other thing is."""
    if depth > 100:
        return f"data nested deeper than 100 at {where}"
    if isinstance(value, PLAIN_SCALARS) and type(value) in PLAIN_SCALARS:
        return ""
    if type(value) in (dict, collections.OrderedDict):
        for key, item in value.items():
            if type(key) is not str:
                return f"the key {key!r} (of type {type(key).__name__}) in {where}"
            problem = check_plain(item, f"{where}[{key!r}]", depth + 1)
            if problem:
                return problem
        return ""
    if type(value) in (list, tuple):
        for index, item in enumerate(value):
            problem = check_plain(item, f"{where}[{index}]", depth + 1)
            if problem:
                return problem
        return ""
    import torch

    if type(value) is torch.Tensor:
        return ""
    kind = type(value)
    return f"a {kind.__module__}.{kind.__qualname__} at {where}" if kind.__module__ != "builtins" else \
        f"a {kind.__name__} at {where}"


def checked_metrics(entry: str, kinds: dict[str, str], values: Any) -> dict[str, float | int]:
    """What ``evaluate`` returned, as Python numbers of each metric's declared kind (module docstring)."""
    if not isinstance(values, dict):
        raise refused(entry, "evaluate", f"returned {type(values).__name__}, not a dict of metrics")
    out: dict[str, float | int] = {}
    for name, value in values.items():
        if type(name) is not str:
            raise refused(entry, "evaluate", f"returned the metric name {name!r}, not a string")
        number, problem = _number(value, kinds.get(name))
        if problem:
            raise refused(entry, "evaluate", f"returned {problem} for metric {name!r} (a "
                          f"{kinds.get(name, 'undeclared')} metric)")
        out[name] = number
    return out


def _number(value: Any, kind: str | None) -> tuple[float | int, str]:
    """(the value as a Python int or float, "") or (0, what is wrong with it)."""
    import numpy as np

    if hasattr(value, "item") and getattr(value, "ndim", None) == 0 and not isinstance(value, np.bool_) \
            and str(getattr(value, "dtype", "")) not in ("bool", "torch.bool"):
        value = value.item()  # a numpy scalar or a 0-dim tensor: its Python number
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return 0, f"{type(value).__name__} {str(value)[:40]!r}, not a number"
    if isinstance(value, numbers.Integral):
        value = int(value)
        if abs(value) > EXACT_INTEGER:
            return 0, f"an integer of {len(str(abs(value)))} digits, beyond what a record holds exactly (2**53)"
        return value, ""
    value = float(value)
    if kind == "count":
        if not math.isfinite(value) or not value.is_integer():
            return 0, f"{value!r}, not a whole number"
        if abs(value) > EXACT_INTEGER:
            return 0, f"{value!r}, beyond what a record holds exactly (2**53)"
        return int(value), ""
    return value, ""  # a non-finite value of a "higher" or "lower" metric is a result (a diverged model)
