"""Evaluating a model on every evaluation split, and checking that evaluating changed nothing.

A task's ``evaluate`` must leave the parameters and every random number generator exactly as it found them:
otherwise an evaluation would change the training that follows it, and a run with more stages would not be the
same run as one with fewer. The driver does not trust this; it checks it, each time, and fails loudly.
"""

from __future__ import annotations

import contextlib
import math
import random
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from opalctl.errors import OpalctlError
from opalctl.tasks.calls import TaskFailed


class EvaluationChangedState(OpalctlError):
    pass


class EvaluateLimit:
    """``limits.evaluate_seconds`` in the process that evaluates (the evaluator, driver/evaluator.py): one call of the
    task's ``evaluate`` that runs past it ends the process. A timer thread hands ``on_expiry`` the sentence (the
    evaluator answers the training process with it, then exits); should the task hold the interpreter in code that
    never lets the thread run, the kernel ends the process ``BACKSTOP_SECONDS`` later (SIGALRM at its default
    action), so a hung evaluate never outlives its limit by more than that."""

    BACKSTOP_SECONDS = 10.0

    def __init__(self, seconds: float, on_expiry: Callable[[TaskFailed], None]):
        self.seconds = float(seconds)
        self.on_expiry = on_expiry

    @contextlib.contextmanager
    def during(self, task, split: str) -> Iterator[None]:
        entry = getattr(task, "entry", type(task).__name__)
        sentence = TaskFailed(f"task {entry}'s evaluate ran past limits.evaluate_seconds ({self.seconds:g} s) on "
                              f"split {split!r}, so the evaluator ended it; make it faster, or freeze the protocol "
                              f"again with a larger limits.evaluate_seconds")
        timer = threading.Timer(self.seconds, self.on_expiry, args=(sentence,))
        timer.daemon = True
        previous = signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, self.seconds + self.BACKSTOP_SECONDS)
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


_limit: EvaluateLimit | None = None  # set only in the evaluator process (``limit_evaluate``)


def limit_evaluate(limit: EvaluateLimit | None) -> None:
    global _limit
    _limit = limit


def _within_limit(task, split: str):
    return _limit.during(task, split) if _limit is not None else contextlib.nullcontext()


def rng_state() -> dict[str, Any]:
    """Every RNG state a task could touch, as plain containers and tensors (loadable with weights_only)."""
    import torch

    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": _python_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _python_state() -> list:
    import torch

    version, internal, gauss = random.getstate()
    # the 625 numbers as one tensor: as a list they were 625 objects to pickle and to walk for the digests at every
    # resume checkpoint, about half of a digits checkpoint's encoding time
    return [int(version), torch.tensor(internal, dtype=torch.int64), gauss]


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32),
                         numpy_state["position"], numpy_state["has_gauss"], numpy_state["cached"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist()), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _same_rng(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    changed = []
    if not torch.equal(a["torch"], b["torch"]):
        changed.append("torch")
    if not torch.equal(a["numpy"]["keys"], b["numpy"]["keys"]) or a["numpy"]["position"] != b["numpy"]["position"]:
        changed.append("numpy")
    (version_a, internal_a, gauss_a), (version_b, internal_b, gauss_b) = a["python"], b["python"]
    if version_a != version_b or not torch.equal(internal_a, internal_b) or gauss_a != gauss_b:
        changed.append("python random")
    if "cuda" in a and "cuda" in b and any(not torch.equal(x, y) for x, y in zip(a["cuda"], b["cuda"])):
        changed.append("cuda")
    return changed


def recorded_metrics(metrics: dict[str, float | int]) -> dict[str, float | int | None]:
    """The metrics as a record holds them (strict JSON): a value that is not finite, as a diverged model's loss
    is, becomes None. The promotion decision saw the value itself, and its checks say it ("nan", "inf")."""
    return {name: value if not isinstance(value, float) or math.isfinite(value) else None
            for name, value in metrics.items()}


def same_bytes(a, b) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes: "unchanged" by what is stored, so a diverged
    model's NaN weights are unchanged when they are the same NaNs (``torch.equal`` calls NaN unequal to itself)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def evaluate_all(task, model, splits: dict[str, Any]) -> dict[str, float | int]:
    """Flat metrics ``{"split.metric": value}`` over every split except ``train``, checked for side effects."""

    before_parameters = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    before_rng = rng_state()
    metrics: dict[str, float | int] = {}
    for split in sorted(splits):
        if split == "train":
            continue
        with _within_limit(task, split):
            values = task.evaluate(model, splits[split])
        for name, value in values.items():
            metrics[f"{split}.{name}"] = value
    after = model.state_dict()
    moved = [name for name, tensor in before_parameters.items()
             if name not in after or not same_bytes(tensor, after[name].detach())]
    task_name = f"task {task.entry}'s" if hasattr(task, "entry") else "the task's"
    if moved:
        raise EvaluationChangedState(f"{task_name} evaluate changed the model's tensors ({', '.join(moved[:3])}); "
                                     f"it must leave them as it found them")
    changed = _same_rng(before_rng, rng_state())
    if changed:
        raise EvaluationChangedState(f"{task_name} evaluate changed the {', '.join(changed)} random state; it must "
                                     f"draw no random numbers, or save and restore the generators it uses")
    return metrics
