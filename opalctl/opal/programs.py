"""Agent programs: the static check that refuses dangerous code, and loading a program as a private module.

An agent writes two ordinary Python files, ``updater.py`` and ``analysis.py``. Before either is loaded it is
parsed and walked: file I/O, processes, sockets, ``eval``/``exec``/``compile``, dynamic imports, and reaching
into other modules' globals or into interpreter internals (dunder attributes) are refused, each with a sentence
the agent can act on. This is a rule enforced at load time, **not a sandbox**: a determined program can still
find a way around it. Its purpose is to keep an honest agent's mistakes (a debug ``open()``, an ``import os``)
out of a training process, and to make any attempt visible in the records.

A program that passes is compiled and executed into a fresh module object that is never put in
``sys.modules`` and never found through ``sys.path``: two versions of ``updater.py`` never share state, and
nothing else in the process can import them.
"""

from __future__ import annotations

import ast
import hashlib
import types
from dataclasses import dataclass

# modules a program may import (and their submodules); everything else is refused
ALLOWED_MODULES = ("math", "torch", "collections", "dataclasses", "functools", "itertools", "typing",
                   "statistics", "numbers", "enum", "operator", "bisect", "heapq", "fractions")
# names that must not be called or referenced
FORBIDDEN_NAMES = {
    "open": "file I/O is not allowed; keep state in memory and return numbers in the report",
    "eval": "eval is not allowed; write the code out",
    "exec": "exec is not allowed; write the code out",
    "compile": "compile is not allowed; write the code out",
    "__import__": "dynamic imports are not allowed; import allowed modules at the top",
    "globals": "reaching into module globals is not allowed",
    "vars": "vars() is not allowed; use the objects you are given",
    "locals": "locals() is not allowed",
    "breakpoint": "breakpoint() is not allowed; training must never stop for a debugger",
    "input": "input() is not allowed; nobody is there to answer",
    "exit": "exit() is not allowed; raise an exception to report a problem",
    "quit": "quit() is not allowed; raise an exception to report a problem",
    "setattr": "setattr() is not allowed; assign attributes directly on your own objects",
    "delattr": "delattr() is not allowed",
}
# attributes of torch (or of any object) that read or write files, load code, or leave the process
FORBIDDEN_ATTRIBUTES = {
    "save": "saving to files is not allowed", "load": "loading from files is not allowed",
    "hub": "torch.hub downloads code and is not allowed", "load_library": "loading libraries is not allowed",
    "from_file": "reading files is not allowed", "tofile": "writing files is not allowed",
    "fromfile": "reading files is not allowed", "cpp_extension": "compiling extensions is not allowed",
    "system": "running commands is not allowed", "popen": "running commands is not allowed",
    "compile": "torch.compile is not allowed in agent programs (it compiles and caches code on disk)",
}


class ProgramRejected(Exception):
    """A program that failed the static check or could not be loaded; the message is for the agent."""


@dataclass
class Program:
    """One version of one program file, loaded."""

    name: str  # "updater" or "analysis"
    source: str
    module: types.ModuleType
    sha256: str


def check_source(source: str, filename: str) -> list[str]:
    """Every reason to refuse ``source`` (empty when it passes), each naming the line."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as error:
        return [f"{filename} line {error.lineno}: syntax error: {error.msg}"]
    problems: list[str] = []

    def refuse(node: ast.AST, text: str) -> None:
        problems.append(f"{filename} line {getattr(node, 'lineno', '?')}: {text}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in ALLOWED_MODULES:
                    refuse(node, f"import of {alias.name!r} is not allowed (allowed: {', '.join(ALLOWED_MODULES)})")
                elif reason := _forbidden_path(alias.name):
                    refuse(node, f"import of {alias.name!r} is not allowed: {reason}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.split(".")[0] not in ALLOWED_MODULES:
                refuse(node, f"import from {module or '.'!r} is not allowed (allowed: {', '.join(ALLOWED_MODULES)})")
            elif reason := _forbidden_path(module):
                refuse(node, f"import from {module!r} is not allowed: {reason}")
            for alias in node.names:
                if alias.name in FORBIDDEN_ATTRIBUTES or alias.name == "*":
                    refuse(node, f"importing {alias.name!r} is not allowed")
        elif isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            refuse(node, f"{node.id}: {FORBIDDEN_NAMES[node.id]}")
        elif isinstance(node, ast.Name) and node.id.startswith("__") and node.id.endswith("__") \
                and node.id not in ("__name__",):
            refuse(node, f"the name {node.id!r} reaches into interpreter internals and is not allowed")
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("__") and node.attr.endswith("__") and node.attr not in ("__init__", "__name__"):
                refuse(node, f"the attribute {node.attr!r} reaches into interpreter internals and is not allowed")
            elif node.attr in FORBIDDEN_ATTRIBUTES:
                refuse(node, f".{node.attr}: {FORBIDDEN_ATTRIBUTES[node.attr]}")
            elif node.attr in ("modules", "_C", "ops", "utils") and _root_name(node) in ("sys", "torch"):
                if node.attr == "utils" and _is_allowed_utils(node):
                    continue
                refuse(node, f"{_dotted(node)} reaches into other modules and is not allowed")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and not name.value.startswith("_")):
                refuse(node, f"{node.func.id}() needs a literal attribute name that does not start with '_'")
            elif name.value in FORBIDDEN_ATTRIBUTES:
                refuse(node, f"{node.func.id}(..., {name.value!r}): {FORBIDDEN_ATTRIBUTES[name.value]}")
        elif isinstance(node, ast.Global):
            refuse(node, "the global statement is not allowed; keep state on your object")
        elif isinstance(node, (ast.AsyncFunctionDef, ast.Await)):
            refuse(node, "async code is not allowed")
    return problems


def _forbidden_path(module: str) -> str | None:
    """Why a dotted module path inside an allowed package is still refused (torch.hub, torch.utils, ...)."""
    parts = module.split(".")
    for index, part in enumerate(parts[1:], start=1):
        if part in FORBIDDEN_ATTRIBUTES:
            return FORBIDDEN_ATTRIBUTES[part]
        if part in ("_C", "ops"):
            return "it reaches into torch internals"
        if part == "utils" and parts[index - 1] != "nn":
            return "torch.utils holds data loaders and extension builders, not optimizer code"
    return None


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _is_allowed_utils(node: ast.Attribute) -> bool:
    # torch.nn.utils (clip_grad_norm_ and friends) is fine; torch.utils (data loaders, cpp extensions) is not
    return isinstance(node.value, ast.Attribute) and node.value.attr == "nn"


def load_program(name: str, source: str, *, label: str = "") -> Program:
    """Check and load ``source`` into a fresh private module; raises ProgramRejected with the reasons."""
    filename = f"{label or name}.py"
    problems = check_source(source, filename)
    if problems:
        raise ProgramRejected("; ".join(problems))
    module = types.ModuleType(f"opalctl_program_{name}")
    module.__file__ = filename
    try:
        code = compile(source, filename, "exec", dont_inherit=True)
        exec(code, module.__dict__)  # noqa: S102 - the point of this module: run a checked program privately
    except Exception as error:  # the program's own top-level code failed
        raise ProgramRejected(f"{filename} failed while loading: {type(error).__name__}: {error}") from None
    return Program(name=name, source=source, module=module, sha256=hashlib.sha256(source.encode()).hexdigest())
