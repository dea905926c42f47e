"""Whether a protocol's optimizer can train: a concrete ``torch.optim`` class, arguments of the types it takes,
and a step that works on the run's device, all found out at freeze rather than in a run's first update.

Each argument is judged by the type of its default (a tuple of two numbers takes a list of two numbers, a flag
takes true or false) before torch sees it, because torch's own checks assume those types and fail in ways that
name nothing (``betas: {a: 1}`` is a KeyError inside torch). What types cannot tell (LBFGS needs a closure,
SparseAdam needs sparse gradients, a value out of range) is found by building the optimizer and stepping it.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any


def _fits(value: Any, default: Any) -> bool:
    """Whether ``value`` (read from YAML) has the type of an optimizer argument whose default is ``default``."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, (tuple, list)):
        return (isinstance(value, list) and len(value) == len(default)
                and all(_fits(item, part) for item, part in zip(value, default)))
    if default is None:  # foreach, fused, max_eval, line_search_fn: torch judges which of these it takes
        return value is None or isinstance(value, (bool, int, float, str))
    if isinstance(default, str):
        return isinstance(value, str)
    return isinstance(value, (int, float)) and not isinstance(value, bool)  # numbers (and required arguments)


def _kind(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, (tuple, list)):
        return f"a list of {len(default)} ({', '.join(_kind(part) for part in default)})"
    if default is None:
        return "a number, true or false, a name or null"
    if isinstance(default, str):
        return "a name"
    return "a number"


def _shown_value(value: Any) -> str:
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    shown = shown if shown.isprintable() else ascii(shown)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _optimizer_class(name: str) -> tuple[Any, str | None]:
    import torch

    cls = getattr(torch.optim, name, None)
    if cls is torch.optim.Optimizer:
        return None, ("torch.optim.Optimizer is the base class of the optimizers, not one; name a concrete "
                      "optimizer such as AdamW or SGD")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        known = sorted(n for n, c in vars(torch.optim).items()
                       if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)
        return None, f"torch.optim has no optimizer {_shown_value(name)} (known: {', '.join(known)})"
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return None, (f"{name} needs a closure that recomputes the loss at every step, which opalctl's "
                      f"training loop does not give; choose another optimizer")
    return cls, None


def check_optimizer(name: str, arguments: dict[str, Any], device: str = "cpu") -> str | None:
    """None when ``name`` is a torch optimizer that takes these arguments and can step on ``device``, else what
    is wrong. Each argument is checked by the type of its default before torch sees it, then the optimizer is
    built and stepped twice on two small parameters (a matrix and a vector, as every model has), and its state
    saved and loaded: what would fail in the first update of a run fails here."""
    cls, reason = _optimizer_class(name)
    if reason:
        return reason
    parameters = inspect.signature(cls.__init__).parameters
    accepted = [n for n in parameters if n not in ("self", "params")]
    for key, value in arguments.items():
        if key not in parameters or key in ("self", "params"):
            return f"{name} takes no argument {_shown_value(key)} (it takes: {', '.join(accepted)})"
        default = parameters[key].default
        if not _fits(value, default):
            return f"{name} argument {key!r} must be {_kind(default)}, not {_shown_value(value)}"
        if not _finite(value):
            return f"{name} argument {key!r} must be finite, not {value!r}"
    if device == "cpu" and arguments.get("capturable") is True:
        return (f"{name} argument 'capturable' needs a CUDA device and training runs on the cpu; remove it "
                f"or set training.device to cuda")
    if arguments.get("differentiable") is True:
        return (f"{name} argument 'differentiable' puts the step in the autograd graph, which opalctl's "
                f"training does not build (the step fails on the model's weights); remove it")
    if device == "cuda":  # built on this machine's CPU: what only a CUDA device takes is left to the run
        arguments = {key: value for key, value in arguments.items() if key not in ("capturable", "fused")}
    if failure := _trial_step(cls, arguments):
        return f"{name} refuses these arguments: {failure}"
    return None


def group_weight_decay_problem(name: str) -> str | None:
    """None when optimizer ``name`` reads a parameter group's ``weight_decay``, else why a group may not set one
    (torch keeps a key its optimizer does not read, so the group would decay as the rest do, silently)."""
    cls, reason = _optimizer_class(name)
    if reason:
        return None  # said at the optimizer's name
    if "weight_decay" not in inspect.signature(cls.__init__).parameters:
        return f"{name} has no weight decay, so a group cannot set one; remove this key"
    return None


def _trial_step(cls, arguments: dict[str, Any]) -> str | None:
    """Build ``cls`` with ``arguments``, step it twice and round-trip its state; the first line of what failed."""
    import torch

    params = [torch.zeros(2, 2, requires_grad=True), torch.zeros(2, requires_grad=True)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a deprecation notice is not a refusal, and stderr stays one line
            optimizer = cls(params, **arguments)
            for _ in range(2):
                for param in params:
                    param.grad = torch.full_like(param, 0.5)
                optimizer.step()
            optimizer.load_state_dict(optimizer.state_dict())
    except Exception as error:  # torch raises many types here (TypeError, KeyError, AssertionError, ...)
        text = " ".join(str(error).split())
        return (text[:160] if text else type(error).__name__).rstrip(".")
    return None


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True
