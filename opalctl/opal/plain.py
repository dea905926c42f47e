"""Plain data: the one check, by exact type, of what agent code made before our code saves, serialises, copies or
compares it.

Agent code may hand back or leave behind any object: a dict subclass whose ``items()`` never returns, a float
subclass whose ``__repr__`` loops, a tensor subclass whose ``__torch_function__`` runs at every operation, a meta
or sparse tensor that ``torch.save`` cannot write. Whatever our code then did with such an object (``json.dumps``,
``torch.save``, ``copy.deepcopy``, even ``len``, ``==`` or ``str``) would run the agent's code outside every guard,
with no time limit. So what goes from agent code into a checkpoint, a record or a snapshot is checked here first,
without calling any method of the object checked: ``type(x) is dict`` and then ``dict.items(x)``, never
``x.items()``. Only what passes reaches ``json.dumps``, ``torch.save`` or a copy.

Plain data is ``None``, ``bool``, ``int``, ``float`` and ``str`` (exact types: no subclass, no numpy scalar),
dicts (exact type) whose keys are among those, lists and tuples (exact types) of plain data and, where tensors may
be held (``tensors="any"``, what a checkpoint holds), tensors of exact type ``torch.Tensor`` or
``torch.nn.Parameter``, dense (``torch.strided``, not nested, not quantized), on the CPU or a CUDA device and not
part of an autograd graph, and torch's own immutable values ``torch.dtype``, ``torch.device`` and ``torch.Size``:
what ``torch.save`` writes and a ``weights_only`` load reads back. A report (``tensors="scalars"``) may hold
one-element tensors, written as their number; the analysis's memory (``tensors="none"``) holds none.

The user's optimizer and scheduler are not the agent's, but a program can leave anything in them (``spec.optimizer``
is handed to ``build``): ``plain_optimizer_state`` and ``plain_entries`` reduce their state dicts to plain data and
say what was left out.
"""

from __future__ import annotations

import json
from typing import Any

import torch

ITEMS_MAX = 1_000_000  # the most containers, numbers and tensors one value may hold
DEPTH_MAX = 32
SCALARS = frozenset({type(None), bool, int, float, str})
TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
TORCH_VALUES = frozenset({torch.dtype, torch.device, torch.Size})
DEVICES = frozenset({"cpu", "cuda"})
TENSOR_MODES = ("any", "scalars", "none")
WHAT_IT_MAY_HOLD = "keep only dicts, lists, tuples, numbers, strings, booleans and None in it"

class NotPlainData(Exception):
    """What agent code handed back is not plain data; the message says where and what to do."""


_TYPE_NAME = type.__dict__["__name__"]  # a class's own name, read without its metaclass's code


def type_name(value: Any) -> str:
    """The name of ``value``'s class, read from the class itself (a metaclass of the agent's cannot run)."""
    return _TYPE_NAME.__get__(type(value))


def shown(value: Any) -> str:
    """``repr(value)`` for plain scalars; the type's name in angle brackets for anything else (never its repr)."""
    return repr(value) if type(value) in SCALARS else f"<{type_name(value)}>"


def _where(path: tuple) -> str:
    return "the value" if not path else "the value at " + "".join(f"[{shown(key)}]" for key in path)


def tensor_problem(tensor: torch.Tensor, tensors: str = "any") -> str | None:
    """Why a tensor of exact type cannot be held here (None when it can), as the end of a sentence."""
    if tensors == "none":
        return "is a tensor; keep numbers here (tensor.item())"
    if tensor.is_nested or tensor.layout is not torch.strided:
        layout = "nested" if tensor.is_nested else str(tensor.layout).removeprefix("torch.")
        return f"is a {layout} tensor; keep only dense tensors (tensor.to_dense())"
    if tensor.is_quantized:
        return "is a quantized tensor; keep only dense tensors of ordinary dtypes (tensor.dequantize())"
    if tensor.device.type not in DEVICES:
        return f"is a tensor on the {tensor.device.type} device; keep only CPU or CUDA tensors"
    if tensor.requires_grad and tensor.grad_fn is not None:
        return "is a tensor that is part of an autograd graph; keep tensor.detach()"
    if tensors == "scalars" and tensor.numel() != 1:
        return f"is a tensor of {tensor.numel()} elements; keep numbers here (tensor.item())"
    return None


def plain_problem(value: Any, tensors: str = "any") -> str | None:
    """Why ``value`` is not plain data (see the module docstring; ``tensors`` is "any", "scalars" or "none"), as a
    sentence naming where it is and what to do; None when it is plain. Calls no method of any object in it."""
    stack: list[tuple[Any, int, tuple]] = [(value, 0, ())]
    count = 0
    while stack:
        item, depth, path = stack.pop()
        count += 1
        if count > ITEMS_MAX or depth > DEPTH_MAX:
            return (f"it is larger or deeper than plain data may be ({ITEMS_MAX} items, depth {DEPTH_MAX}); keep "
                    f"less in it")
        kind = type(item)
        if kind in SCALARS:
            continue
        if kind is dict:
            for key, child in dict.items(item):
                if type(key) not in SCALARS:
                    return (f"{_where(path)} has a key of type {type_name(key)}; keys must be strings, numbers, "
                            f"booleans or None")
                stack.append((child, depth + 1, (*path, key)))
        elif kind is list or kind is tuple:
            stack.extend((child, depth + 1, (*path, index)) for index, child in enumerate(item))
        elif kind in TENSOR_TYPES:
            problem = tensor_problem(item, tensors)
            if problem is not None:
                return f"{_where(path)} {problem}"
        elif kind not in TORCH_VALUES or tensors != "any":
            return f"{_where(path)} is a {type_name(item)}; {WHAT_IT_MAY_HOLD}" + \
                   ("" if tensors == "none" else " (and dense CPU or CUDA tensors)")
    return None


def plain_copy(value: Any) -> Any:
    """A deep copy of plain data (checked by ``plain_problem`` first): containers rebuilt, tensors detached and
    cloned, the rest shared (immutable)."""
    kind = type(value)
    if kind is dict:
        return {key: plain_copy(child) for key, child in dict.items(value)}
    if kind is list:
        return [plain_copy(child) for child in value]
    if kind is tuple:
        return tuple(plain_copy(child) for child in value)
    if kind in TENSOR_TYPES:
        return value.detach().clone()
    return value


def plain_number(value: Any) -> float | None:
    """``value`` as a float when it is a number of exact type (``bool`` aside) or a one-element tensor that is plain
    data; None for anything else (reading it would run its code)."""
    kind = type(value)
    if kind is int or kind is float:
        return float(value)
    if kind in TENSOR_TYPES and tensor_problem(value, "scalars") is None:
        return float(value)
    return None


def _tensor_number(tensor: torch.Tensor) -> float:
    """``json.dumps``'s ``default`` for a checked report: only one-element tensors of exact type reach it."""
    return float(tensor)


def json_text(value: Any, tensors: str = "none") -> tuple[str | None, str | None]:
    """``value`` as JSON text when it is plain data (one-element tensors written as numbers with ``tensors=
    "scalars"``): ``(text, None)``, or ``(None, why not)``. ``json.dumps`` only ever sees exact types."""
    problem = plain_problem(value, tensors)
    if problem is not None:
        return None, problem
    try:
        return json.dumps(value, default=_tensor_number), None
    except ValueError as error:  # an integer longer than Python converts to text, say
        return None, f"it cannot be written as JSON ({error})"


# -- the user's optimizer and scheduler ----------------------------------------------------------------------------
# Looking a key up (``d.get(key)``, ``key in d``) compares it with the keys of the same hash, and a key of the agent's
# would run its ``__eq__``: these functions only iterate, and look up only in dicts whose keys are exact strings.

def string_keyed(value: Any) -> dict[str, Any]:
    """The entries of a dict (exact type) whose keys are exact strings, in a dict of our own; {} for anything else."""
    if type(value) is not dict:
        return {}
    return {key: entry for key, entry in dict.items(value) if type(key) is str}


def _parameter_indices(params: Any) -> bool:
    return type(params) is list and all(type(index) is int for index in params)


def plain_optimizer_state(state: Any, defaults: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """A torch optimizer's ``state_dict()`` reduced to plain data, and what was left out, each in a few words.

    A program may leave anything in the user's optimizer (it is ``spec.optimizer``). The reduction keeps what the
    optimizer can go on from: a parameter's state that holds anything else is left out whole (torch's optimizers
    start a parameter without state afresh at its next step, where one entry missing from it would be an error);
    a state entry that is not a parameter's is left out; a group's setting that is not plain data takes the
    optimizer's default (``defaults``), as torch gives a group that lacks one, or is left out when there is none.
    The first value is None when the state does not have the shape of a torch optimizer's (state and
    param_groups, each group with its parameter indices): then nothing of it can be kept."""
    entries = string_keyed(state)
    if type(state) is not dict or type(entries.get("state")) is not dict or \
            type(entries.get("param_groups")) is not list:
        return None, ["the optimizer's state dict does not have the shape of a torch optimizer's"]
    dropped: list[str] = []
    per_parameter = {}
    for key, entry in dict.items(entries["state"]):
        problem = plain_problem(entry) if type(key) is int else "it is not a parameter's"
        if problem is None:
            per_parameter[key] = entry
        else:
            dropped.append(f"the state of parameter {shown(key)} ({problem}): it starts afresh")
    settings = string_keyed(defaults)
    groups = []
    for group in entries["param_groups"]:
        if type(group) is not dict or not _parameter_indices(string_keyed(group).get("params")):
            return None, ["a parameter group is not a dict holding its parameter indices; the optimizer's state "
                          "cannot be kept"]
        groups.append(_plain_group(group, settings, dropped))
    kept = {"state": per_parameter, "param_groups": groups}
    for key, value in dict.items(state):  # a custom optimizer's own entries, when plain
        if type(key) is str and key not in kept:
            if plain_problem(value) is None:
                kept[key] = value
            else:
                dropped.append(f"the optimizer's entry {key!r}")
        elif type(key) is not str:
            dropped.append(f"the optimizer's entry {shown(key)}")
    return kept, dropped


def _plain_group(group: dict, settings: dict[str, Any], dropped: list[str]) -> dict[str, Any]:
    kept = {}
    for key, value in dict.items(group):
        if type(key) is not str:
            dropped.append(f"a group's entry {shown(key)}")
        elif plain_problem(value) is None:
            kept[key] = value
        elif key in settings and plain_problem(settings[key]) is None:
            kept[key] = settings[key]
            dropped.append(f"the group setting {key!r} (back at the optimizer's default)")
        else:
            dropped.append(f"the group setting {key!r}")
    return kept


def plain_entries(state: Any, what: str) -> tuple[dict[str, Any] | None, list[str]]:
    """A state dict (a scheduler's, say) with its entries that are not plain data left out, and what was left out;
    None when it is not a dict."""
    if type(state) is not dict:
        return None, [f"{what}'s state dict is a {type_name(state)}, not a dict"]
    kept, dropped = {}, []
    for key, value in dict.items(state):
        if type(key) in SCALARS and plain_problem(value) is None:
            kept[key] = value
        else:
            dropped.append(f"{what}'s entry {shown(key)}")
    return kept, dropped
