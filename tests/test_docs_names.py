"""docs/architecture.md names only what the code has: every backticked file path, ``module.name``, class, constant
and function name in it is found in opalctl's source, read with ``ast`` (nothing imported, no torch), so a rename
or a removal that leaves the page behind fails here.

What is checked, by the shape of the backticked text:

- ``driver/run.py``, ``opalctl/layout.py``: a file beneath ``opalctl/`` or the repository (a bare ``spec.py`` in a
  row of the rooms table may also lie in that row's room, ``suite/``); a folder (``grid/``) only where it names a
  room, in the table's first column (elsewhere ``training/`` is a run folder's);
- ``driver/show_render.rule_of``: a name defined in that file;
- ``build.choose_arm``, ``driver.run.run``, ``opalctl.grid.run_grid``: a module of that name (its last parts) that
  defines or imports the name; ``gc.freeze``: a standard library module that has it;
- ``RunLayout.state``: a class of opalctl with that member (a method, a field, an attribute its methods set);
- ``training.checkpoint_every``, ``arms.NAME.groups``: a protocol key, each part a field of the schema's model
  (``NAME`` stands for any name);
- ``FormalRun``, ``STOP_WAIT_SECONDS``, ``claim_folder``: a class, a constant, a function, method or attribute
  defined somewhere in opalctl (or a Python built-in).

Plain words (``verify``, ``state``), commands (``opalctl run``), flags and run-folder files (``start.json``) are
not names of the code and are left alone.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "opalctl"
DOC = REPO / "docs" / "architecture.md"

# torch's, named where the page says what a program that patches torch could change; no torch import to check them
THIRD_PARTY = {"Tensor": {"sum"}, "Linear": {"forward"}}

# a run folder's files and the pages beside the code: ``report.json`` is no module ``report`` with a ``json``
FILE_KINDS = {"json", "jsonl", "gz", "pt", "yaml", "md", "html", "log", "lock", "tmp", "csv", "txt"}
IDENTIFIER = r"[A-Za-z_]\w*"
CAMEL = re.compile(r"_?[A-Z][a-z0-9]+[A-Za-z0-9]*")
CONSTANT = re.compile(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)+|[A-Z]{3,}")
SNAKE = re.compile(r"_?[a-z][a-z0-9]*(_[a-z0-9]+)+")
DOTTED = re.compile(rf"{IDENTIFIER}(\.{IDENTIFIER})+")
PATH_NAME = re.compile(rf"([\w/]+/\w+)\.({IDENTIFIER})")  # driver/show_render.rule_of


@dataclass
class Module:
    dotted: str  # opalctl.driver.run
    path: Path
    names: set[str] = field(default_factory=set)  # defined or imported at its top level


@dataclass
class Index:
    """What opalctl's source defines, by ``ast``."""

    modules: dict[str, Module] = field(default_factory=dict)
    classes: dict[str, list[set[str]]] = field(default_factory=dict)  # class name -> members of each such class
    class_bases: dict[str, list[list[str]]] = field(default_factory=dict)
    defined: set[str] = field(default_factory=set)  # every function, method, attribute, field and constant

    def members(self, name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        """Every member of the classes called ``name``, their bases' (those defined in opalctl) included."""
        found: set[str] = set()
        for own, bases in zip(self.classes.get(name, []), self.class_bases.get(name, []), strict=True):
            found |= own
            for base in bases:
                if base not in seen:
                    found |= self.members(base, seen | {name})
        return found

    def modules_named(self, parts: list[str]) -> list[Module]:
        """The modules whose dotted name ends with ``parts`` (``["build"]``: opalctl.driver.build)."""
        suffix = ".".join(parts)
        return [module for dotted, module in self.modules.items()
                if dotted == suffix or dotted.endswith("." + suffix)]


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for element in node.elts for name in _targets(element)]
    return []


@cache
def index() -> Index:
    found = Index()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = Module(".".join(parts), path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                module.names.add(node.name)
            elif isinstance(node, ast.Assign):
                module.names.update(name for target in node.targets for name in _targets(target))
            elif isinstance(node, ast.AnnAssign):
                module.names.update(_targets(node.target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                module.names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        found.modules[module.dotted] = module
        found.defined |= module.names | {module.dotted.rpartition(".")[2]}  # slurm_task names a module
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.defined.add(node.name)
                found.defined.update(arg.arg for arg in node.args.kwonlyargs + node.args.args)
            elif isinstance(node, ast.ClassDef):
                members: set[str] = set()
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and item is not node:
                        members.add(item.name)
                    elif isinstance(item, ast.Assign):
                        members.update(name for target in item.targets for name in _targets(target))
                    elif isinstance(item, ast.AnnAssign):
                        members.update(_targets(item.target))
                    if isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                                if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) \
                                        and element.value.id in ("self", "cls"):
                                    members.add(element.attr)
                found.classes.setdefault(node.name, []).append(members)
                found.class_bases.setdefault(node.name, []).append(
                    [base.id for base in node.bases if isinstance(base, ast.Name)])
                found.defined |= members
    return found


# -- the protocol's keys --------------------------------------------------------------------------------------------

@cache
def schema_fields() -> dict[str, dict[str, set[str]]]:
    """Each model class of protocol/schema.py: its fields and the schema classes each field's annotation names."""
    tree = ast.parse((PACKAGE / "protocol" / "schema.py").read_text(encoding="utf-8"))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    models: dict[str, dict[str, set[str]]] = {}

    def fields_of(name: str) -> dict[str, set[str]]:
        if name in models:
            return models[name]
        node, own = classes[name], {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                own.update(fields_of(base.id))
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                own[item.target.id] = {sub.id for sub in ast.walk(item.annotation)
                                       if isinstance(sub, ast.Name) and sub.id in classes}
        models[name] = own
        return own

    for name in classes:
        fields_of(name)
    return models


def protocol_key_problem(parts: list[str]) -> str | None:
    """None when ``parts`` is a key of the protocol (``agent.notes`` is an arm's ``agent:``), else why not."""
    models = schema_fields()
    current = {"Protocol"} if parts[0] in models["Protocol"] else {"AgentSpec"}
    if parts[0] not in models["Protocol"]:
        parts = parts[1:]
    for part in parts:
        if part.isupper():  # NAME: the name of an arm, a split, a metric
            continue
        holders = [model for model in current if part in models[model]]
        if not holders:
            return f"no field {part!r} in {', '.join(sorted(current))} (protocol/schema.py)"
        current = set().union(*(models[model][part] for model in holders)) or {"(a value)"}
        models.setdefault("(a value)", {})
    return None


def protocol_sections() -> set[str]:
    return set(schema_fields()["Protocol"]) | {"agent"}


# -- the checks -----------------------------------------------------------------------------------------------------

def _stdlib_has(parts: list[str]) -> bool | None:
    """Whether the standard library module ``parts[0]`` has the rest; None when it is no standard module."""
    if parts[0] not in sys.stdlib_module_names:
        return None
    value = importlib.import_module(parts[0])
    for part in parts[1:]:
        if not hasattr(value, part):
            return False
        value = getattr(value, part)
    return True


def _file_problem(text: str, rooms: list[str]) -> str | None:
    if text.endswith("/"):
        return None if (PACKAGE / text).is_dir() or (REPO / text).is_dir() else f"no folder {text}"
    candidates = [PACKAGE / text, REPO / text]
    if "/" not in text:
        candidates += [PACKAGE / room / text for room in rooms if room.endswith("/")]
        candidates += [PACKAGE / Path(room).parent / text for room in rooms if room.endswith(".py")]
    return None if any(path.is_file() for path in candidates) else f"no file {text} (beneath opalctl/ or the repository)"


def name_problem(text: str, rooms: list[str], is_room: bool = False) -> str | None:
    """Why the backticked ``text`` names nothing in the code, or None (also for text that is no name of code)."""
    found = index()
    text = re.sub(r"\(.*\)$", "", text.strip())  # driver.run.run(lock, arm, seed), main(), build()
    if text.startswith("opalctl/"):
        text = text.removeprefix("opalctl/") or "./"
    if text.endswith(".py") or (is_room and text.endswith("/")):
        return _file_problem(text, rooms)
    if (match := PATH_NAME.fullmatch(text)) and match[2] not in FILE_KINDS:
        module = found.modules.get("opalctl." + match[1].replace("/", "."))
        if module is None:
            return f"no module opalctl/{match[1]}.py"
        return None if match[2] in module.names else f"opalctl/{match[1]}.py defines no {match[2]}"
    if DOTTED.fullmatch(text) and text.rpartition(".")[2] not in FILE_KINDS:
        parts = text.split(".")
        if parts[0] in protocol_sections():
            return protocol_key_problem(parts)
        if parts[0] in THIRD_PARTY:
            return None if set(parts[1:]) <= THIRD_PARTY[parts[0]] else f"{text} is not one of the torch names kept"
        if parts[0][0].isupper():
            members = found.members(parts[0])
            if parts[0] not in found.classes:
                return f"no class {parts[0]} in opalctl"
            return None if parts[1] in members else f"class {parts[0]} has no member {parts[1]}"
        for cut in range(len(parts) - 1, 0, -1):  # the longest run of parts that names a module
            modules = found.modules_named(parts[:cut])
            if modules:
                rest = parts[cut:]
                if any(rest[0] in module.names or f"{module.dotted}.{rest[0]}" in found.modules
                       for module in modules):
                    if len(rest) == 1 or rest[0] not in found.classes:
                        return None
                    return None if rest[1] in found.members(rest[0]) else f"class {rest[0]} has no member {rest[1]}"
                return f"module {'.'.join(parts[:cut])} defines no {rest[0]}"
        if parts[0] == "opalctl" and ".".join(parts) in found.modules:
            return None
        std = _stdlib_has(parts)
        if std is not None:
            return None if std else f"the standard library has no {text}"
        return f"no module {parts[0]} in opalctl"
    if re.fullmatch(IDENTIFIER, text):
        if hasattr(builtins, text):
            return None
        if CAMEL.fullmatch(text):
            return None if text in found.classes or text in found.defined else f"no class {text} in opalctl"
        if CONSTANT.fullmatch(text) or SNAKE.fullmatch(text):
            return None if text in found.defined else f"nothing named {text} in opalctl"
    return None


def names_in(markdown: str) -> list[tuple[int, str, list[str], bool]]:
    """Each backticked text: its line number, the text, the rooms of its table row (first cell), whether it is one."""
    out = []
    for number, line in enumerate(markdown.splitlines(), 1):
        cells = line.split("|")[1:-1] if line.startswith("|") else []
        first = cells[0] if cells else ""
        rooms = re.findall(r"`([^`]+)`", first)
        for match in re.finditer(r"`([^`]+)`", line):
            in_first = bool(cells) and match.start() < len(first) + 1
            out.append((number, match[1], rooms, in_first))
    return out


def problems_of(markdown: str) -> list[str]:
    return [f"line {number}: `{text}`: {problem}" for number, text, rooms, is_room in names_in(markdown)
            if (problem := name_problem(text, rooms, is_room))]


def test_every_name_the_architecture_page_gives_is_in_the_code():
    assert problems_of(DOC.read_text(encoding="utf-8")) == []


def test_the_check_finds_a_name_the_code_lacks():
    """The check above can fail: a page naming a file, a function, a class member, a class, a constant and a
    protocol key that do not exist is refused for each, and the real names beside them pass."""
    planted = ("| `driver/`, `driver/nowhere.py` | `choose_arm` and `build.choose_arm` |\n"
               "| `suite/` | `spec.py`, `no_such.py` |\n"
               "`build.choose_harm`, `RunLayout.stat`, `RunLayout.state`, `FormalRunner`, `FormalRun`, "
               "`MAX_BITES`, `STOP_WAIT_SECONDS`, `claim_folders`, `claim_folder`, `training.checkpoint_evry`, "
               "`training.checkpoint_every`, `arms.NAME.groups`, `gc.freez`, `gc.freeze`, "
               "`driver/show_render.rule_off`, `driver/show_render.rule_of`\n")
    found = problems_of(planted)
    wrong = ["driver/nowhere.py", "no_such.py", "build.choose_harm", "RunLayout.stat", "FormalRunner", "MAX_BITES",
             "claim_folders", "training.checkpoint_evry", "gc.freez", "driver/show_render.rule_off"]
    assert [problem.split("`")[1] for problem in found] == wrong, found


def cited_titles() -> list[tuple[str, str]]:
    """Each reason the code and the other pages cite by title (``docs/architecture.md, "Why ..."``): (file, title)."""
    cited = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "docs").glob("*.md"), REPO / "README.md"]:
        text = " ".join(path.read_text(encoding="utf-8").split())
        cited += [(path.relative_to(REPO).as_posix(), title)
                  for title in re.findall(r'docs/architecture\.md, "([^"]+)"', text)]
    return cited


def test_every_reason_cited_by_title_is_on_the_page():
    page = " ".join(DOC.read_text(encoding="utf-8").split())
    titles = {title.strip().rstrip(".") for title in re.findall(r"\*\*([^*]+)\*\*", page)}
    cited = cited_titles()
    assert cited, "the code cites reasons of the page by title (driver/evaluator.py, compare/target.py)"
    assert [(where, title) for where, title in cited if title.strip().rstrip(".") not in titles] == []
