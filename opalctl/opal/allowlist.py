"""The static check of an agent's program: an allowlist of what a program may import and reach, checked on the
syntax tree before any of the program's code runs.

What a program may use:

- the modules in ``MODULES`` (torch's tensor math, ``math`` and a few pure standard-library modules), imported
  with ``import``/``from ... import``; a name bound to a module may only be followed by ``.name``, and every
  dotted chain from it is resolved against the real modules (without importing anything but allowed modules):
  a chain that reaches any other module (``torch.os``, ``typing.sys``, ``torch.nn.functional.np``,
  ``torch.serialization``) or a private member (``torch._C``; ``torch._foreach_*`` excepted) is refused;
- of the standard-library modules, only the names listed for each in ``MODULES``;
- the builtins in ``BUILTINS``; every other builtin name is refused wherever it appears;
- its own state: attributes are assigned (or deleted) only as ``self.name`` inside the methods of its own
  classes, and its classes are used to build objects, in ``isinstance``, as bases, or for their constants,
  static and class methods (never to call an instance method on a foreign object).

Refused as members of a module: torch's global settings (``torch.set_num_threads``, ``torch.manual_seed``, every
``set_*`` but ``set_grad_enabled``). Refused everywhere, whatever the object: dunder attributes and names
(``__init__``/``__name__`` excepted), frame, code and traceback attributes (``f_locals``, ``gi_frame``,
``tb_frame``, ...), anything named like a hook, files and processes (``save``, ``load``, ``tofile``, ``dump``,
``numpy``, ...), private attributes but on ``self``, ``getattr``/``hasattr`` other than called with a literal
name, attribute assignments other than ``self.name`` (and a tensor's ``.data``/``.grad``), ``str.format`` other than
on a literal whose fields reach no attribute, and defining dunder methods beyond a few harmless ones (our code
formats and compares what a program returns: a ``__str__`` or ``__float__`` of its own would run outside its
time limit).

This is one layer of three (the others: the guards around each program call in ``guard.py``, and the operating
system's confinement of the training process; see docs/architecture.md): it stops what it can name, and it
tells an honest agent what to write instead.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import string
import types
from typing import Any

TORCH = None  # every public member of an allowed torch module, unless refused by name below
MATH = None
MODULES: dict[str, frozenset[str] | None] = {
    "math": MATH, "torch": TORCH, "torch.nn": TORCH, "torch.nn.functional": TORCH, "torch.nn.init": TORCH,
    "torch.nn.utils": TORCH, "torch.optim": TORCH, "torch.optim.lr_scheduler": TORCH, "torch.linalg": TORCH,
    "torch.special": TORCH, "torch.fft": TORCH,
    "collections": frozenset({"OrderedDict", "defaultdict", "deque", "Counter", "namedtuple", "ChainMap", "abc"}),
    "collections.abc": frozenset({"Mapping", "MutableMapping", "Sequence", "MutableSequence", "Iterable",
                                  "Iterator", "Callable", "Set", "Sized", "Container"}),
    "itertools": frozenset({"accumulate", "chain", "combinations", "count", "cycle", "groupby", "islice",
                            "pairwise", "product", "repeat", "starmap", "takewhile", "dropwhile", "zip_longest",
                            "permutations", "tee", "compress", "filterfalse", "batched"}),
    "functools": frozenset({"partial", "reduce", "lru_cache", "cache", "cached_property", "wraps",
                            "total_ordering", "cmp_to_key"}),
    "operator": frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "abs", "itemgetter",
                           "lt", "le", "gt", "ge", "eq", "ne", "and_", "or_", "not_", "matmul"}),
    "typing": frozenset({"Any", "Optional", "Union", "List", "Dict", "Tuple", "Set", "FrozenSet", "Callable",
                         "Iterable", "Iterator", "Sequence", "Mapping", "MutableMapping", "NamedTuple",
                         "Literal", "Final", "ClassVar", "TypeVar", "Generic", "TYPE_CHECKING"}),
    "dataclasses": frozenset({"dataclass", "field", "fields", "asdict", "astuple", "replace", "InitVar"}),
    "statistics": frozenset({"mean", "median", "median_low", "median_high", "stdev", "pstdev", "variance",
                             "pvariance", "fmean", "geometric_mean", "harmonic_mean", "quantiles", "mode"}),
    "numbers": frozenset({"Number", "Real", "Integral", "Complex", "Rational"}),
    "enum": frozenset({"Enum", "IntEnum", "auto"}),
    "bisect": frozenset({"bisect", "bisect_left", "bisect_right", "insort", "insort_left", "insort_right"}),
    "heapq": frozenset({"heappush", "heappop", "heapify", "heapreplace", "heappushpop", "nlargest", "nsmallest"}),
    "fractions": frozenset({"Fraction"}),
    "copy": frozenset({"copy", "deepcopy"}),
}
BUILTINS = frozenset({
    "abs", "all", "any", "bool", "callable", "chr", "classmethod", "complex", "dict", "divmod", "enumerate",
    "filter", "float", "format", "frozenset", "getattr", "hasattr", "hash", "hex", "id", "int", "isinstance",
    "issubclass", "iter", "len", "list", "map", "max", "min", "next", "object", "oct", "ord", "pow", "print",
    "property", "range", "repr", "reversed", "round", "set", "slice", "sorted", "staticmethod", "str", "sum",
    "super", "tuple", "type", "zip", "bin", "NotImplemented", "Ellipsis", "True", "False", "None",
    "ArithmeticError", "AssertionError", "AttributeError", "BaseException", "Exception", "FloatingPointError",
    "IndexError", "KeyError", "LookupError", "NotImplementedError", "OverflowError", "RuntimeError",
    "StopIteration", "TypeError", "ValueError", "ZeroDivisionError", "Warning", "UserWarning", "RecursionError",
    "MemoryError", "SystemExit", "KeyboardInterrupt", "GeneratorExit",  # raising them is a failure like any other
})
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
_GLOBAL_STATE = ("torch's global settings (threads, default dtype, random state) belong to the run and are put back "
                 "after each call; leave them alone (for random numbers use a torch.Generator of your own)")
FORBIDDEN_ATTRIBUTES = {
    "save": "saving to files is not allowed", "load": "loading from files is not allowed",
    "hub": "torch.hub downloads code and is not allowed", "load_library": "loading libraries is not allowed",
    "from_file": "reading files is not allowed", "tofile": "writing files is not allowed",
    "fromfile": "reading files is not allowed", "cpp_extension": "compiling extensions is not allowed",
    "system": "running commands is not allowed", "popen": "running commands is not allowed",
    "compile": "torch.compile is not allowed in agent programs (it compiles and caches code on disk)",
    "dump": "writing files is not allowed", "numpy": "leaving torch for numpy is not allowed; use tensor methods",
    "attrgetter": "attrgetter is not allowed; write the attribute out", "methodcaller": "write the call out",
    "get_type_hints": "evaluating annotations is not allowed", "singledispatch": "singledispatch is not allowed",
    "inference_mode": "use torch.no_grad() instead",
}
# members of a module (not of an object: a torch.Generator of the program's own may be seeded) that change
# torch's global settings; so does every module member named set_* but set_grad_enabled
GLOBAL_SETTINGS = frozenset({"manual_seed", "seed", "set_rng_state", "use_deterministic_algorithms"})
# attribute prefixes that reach frames, code objects and tracebacks (and through them every caller's locals)
FRAME_PREFIXES = ("f_", "gi_", "cr_", "ag_", "tb_", "co_")
DUNDER_ATTRIBUTES = frozenset({"__init__", "__name__"})
DUNDER_METHODS = frozenset({"__init__", "__call__", "__post_init__"})  # what a program's classes may define
CLASS_DECORATORS = frozenset({"dataclass", "total_ordering"})
TENSOR_STORES = frozenset({"data", "grad"})  # assignable on a tensor held in a variable (p.data = ..., p.grad = None)
MODULE_HINT = "a module may only be used as module.name; import what you need (import torch.nn as nn)"


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def attribute_problem(name: str) -> str | None:
    """Why the attribute ``name`` is refused on any object (None when it is not)."""
    if _is_dunder(name) and name not in DUNDER_ATTRIBUTES:
        return f"the attribute {name!r} reaches into interpreter internals and is not allowed"
    if name.startswith(FRAME_PREFIXES):
        return f"the attribute {name!r} reaches frames, code or tracebacks and is not allowed"
    if "hook" in name.lower():
        return f".{name}: hooks run code outside the program's call and are not allowed"
    if name in FORBIDDEN_ATTRIBUTES:
        return f".{name}: {FORBIDDEN_ATTRIBUTES[name]}"
    return None


def resolve_import(dotted: str) -> types.ModuleType | None:
    """The allowed module ``dotted`` (imported if need be), or None when it is not allowed."""
    return importlib.import_module(dotted) if dotted in MODULES else None


def member(module: types.ModuleType, name: str) -> tuple[Any, str | None]:
    """``module.name`` as the program would reach it, found without running any lazy import: (the value, None),
    or (None, why it is refused)."""
    allowed = MODULES[module.__name__]
    if allowed is not None and name not in allowed:
        return None, f"{module.__name__}.{name} is not available to a program (allowed: {', '.join(sorted(allowed))})"
    if name in GLOBAL_SETTINGS or (name.startswith("set_") and name != "set_grad_enabled"):
        return None, f"{module.__name__}.{name}: {_GLOBAL_STATE}"
    if name.startswith("_") and not name.startswith("_foreach_"):
        return None, f"{module.__name__}.{name} is private to torch and is not allowed"
    if f"{module.__name__}.{name}" in MODULES:
        return importlib.import_module(f"{module.__name__}.{name}"), None
    value = vars(module).get(name, _MISSING)
    if value is _MISSING:
        return None, f"{module.__name__} has no attribute {name!r} a program may use"
    if isinstance(value, types.ModuleType):
        return None, (f"{module.__name__}.{name} is the module {value.__name__!r}, which a program may not reach "
                      f"(allowed modules: {', '.join(MODULES)})")
    return value, None


def static_member(value: Any, name: str) -> Any:
    """``value.name`` found statically on a class or function (``_MISSING`` when it cannot be told)."""
    try:
        return inspect.getattr_static(value, name)
    except AttributeError:
        return _MISSING


_MISSING = object()


def format_fields_problem(text: str) -> str | None:
    """Why the literal format string ``text`` is refused: a field that reaches an attribute or an item."""
    try:
        fields = [field for _, field, spec, _ in string.Formatter().parse(text) if field is not None]
    except ValueError as error:
        return f"the format string is not valid ({error})"
    if any("." in field or "[" in field for field in fields):
        return "format fields that reach attributes or items ({0.name}, {0[key]}) are not allowed; use an f-string"
    return None


BUILTIN_NAMES = frozenset(dir(builtins))


class _Facts:
    """What the first pass over a program learns: each node's parent, the names its imports bind (to a module,
    or to a member of one), its classes (and which of their names are instance methods), the ``self`` and ``cls``
    parameters of their methods, and every name it binds."""

    def __init__(self, tree: ast.Module):
        self.parents: dict[ast.AST, ast.AST] = {}
        self.modules: dict[str, types.ModuleType] = {}  # name -> the allowed module it is bound to
        self.imported: set[str] = set()  # every name an import binds
        self.imported_classes: set[str] = set()  # names an import binds to a class (from torch import Tensor)
        self.classes: set[str] = set()
        self.instance_methods: set[str] = set()
        self.receivers: dict[ast.AST, tuple[str, str]] = {}  # method -> (first parameter, "self" or "cls")
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.ClassDef):
                self._class(node)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self._bind_import(alias)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    self.imported.add(alias.asname or alias.name)
                    module = resolve_import(node.module or "") if not node.level else None
                    if module is not None and alias.name != "*":
                        value, _ = member(module, alias.name)
                        if isinstance(value, types.ModuleType):
                            self.modules[alias.asname or alias.name] = value
                        elif isinstance(value, type):
                            self.imported_classes.add(alias.asname or alias.name)

    def _bind_import(self, alias: ast.alias) -> None:
        bound = alias.asname or alias.name.split(".")[0]
        self.imported.add(bound)
        target = alias.name if alias.asname else alias.name.split(".")[0]
        module = resolve_import(target)
        if module is not None:
            self.modules[bound] = module

    def _class(self, node: ast.ClassDef) -> None:
        self.classes.add(node.name)
        for item in node.body:
            if not isinstance(item, ast.FunctionDef) or not item.args.args:
                continue
            decorators = {d.id for d in item.decorator_list if isinstance(d, ast.Name)}
            if "staticmethod" in decorators:
                continue
            kind = "cls" if "classmethod" in decorators else "self"
            if kind == "self" and "property" not in decorators:
                self.instance_methods.add(item.name)
            self.receivers[item] = (item.args.args[0].arg, kind)

    def method_of(self, node: ast.AST) -> tuple[ast.FunctionDef, str, str] | None:
        """The method of one of the program's classes whose body holds ``node`` (its receiver and kind)."""
        while node in self.parents:
            node = self.parents[node]
            if node in self.receivers:
                name, kind = self.receivers[node]
                return node, name, kind
        return None

    def rebinds(self, method: ast.FunctionDef, name: str) -> bool:
        """Whether ``name`` is bound anywhere inside ``method`` but as its first parameter."""
        for node in ast.walk(method):
            if isinstance(node, ast.Name) and node.id == name and not isinstance(node.ctx, ast.Load):
                return True
            if isinstance(node, ast.arg) and node.arg == name and node is not method.args.args[0]:
                return True
        return False


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "(...)")
    return ".".join(reversed(parts))


class _Checker:
    """The second pass: each node against the rules of the module docstring; ``problems`` are (line, text)."""

    def __init__(self, facts: _Facts):
        self.facts = facts
        self.problems: list[tuple[int, str]] = []

    def refuse(self, node: ast.AST, text: str) -> None:
        self.problems.append((getattr(node, "lineno", 0), text))

    def check(self, node: ast.AST) -> None:
        handler = getattr(self, f"_{type(node).__name__}", None)
        if handler is not None:
            handler(node)

    def _parent(self, node: ast.AST) -> ast.AST | None:
        return self.facts.parents.get(node)

    # -- imports --------------------------------------------------------------------------------------------
    def _Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name not in MODULES:
                self.refuse(node, f"import of {alias.name!r} is not allowed (allowed: {', '.join(MODULES)})")

    def _ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level or module not in MODULES:
            self.refuse(node, f"import from {module or '.'!r} is not allowed (allowed: {', '.join(MODULES)})")
            return
        for alias in node.names:
            if alias.name == "*":
                self.refuse(node, "importing '*' is not allowed; import the names you use")
            elif problem := attribute_problem(alias.name):
                self.refuse(node, f"importing {alias.name!r} is not allowed: {problem}")
            else:
                _, why = member(resolve_import(module), alias.name)
                if why:
                    self.refuse(node, why)

    # -- names ----------------------------------------------------------------------------------------------
    def _Name(self, node: ast.Name) -> None:
        name = node.id
        if name in FORBIDDEN_NAMES:
            self.refuse(node, f"{name}: {FORBIDDEN_NAMES[name]}")
        elif _is_dunder(name) and name != "__name__":
            self.refuse(node, f"the name {name!r} reaches into interpreter internals and is not allowed")
        elif name in BUILTIN_NAMES and name not in BUILTINS:
            self.refuse(node, f"the builtin {name!r} is not available to a program (rename it if it is your own)")
        if not isinstance(node.ctx, ast.Load):
            if name in self.facts.imported:
                self.refuse(node, f"{name!r} is an imported name; do not rebind it, use a name of your own")
            return
        parent = self._parent(node)
        if name in self.facts.modules and not (isinstance(parent, ast.Attribute) and parent.value is node):
            self.refuse(node, f"{name}: {MODULE_HINT}")
        elif name in ("getattr", "hasattr") and not (isinstance(parent, ast.Call) and parent.func is node):
            self.refuse(node, f"{name} may only be called directly, with a literal attribute name")
        elif name in self.facts.classes or name in self.facts.imported_classes or self._is_class_receiver(node):
            self._class_use(node, parent)

    def _is_class_receiver(self, node: ast.Name) -> bool:
        found = self.facts.method_of(node)
        return found is not None and found[2] == "cls" and found[1] == node.id

    def _class_use(self, node: ast.expr, parent: ast.AST | None) -> None:
        """A class (the program's, a classmethod's ``cls``, or one from a module) may build objects, be tested
        against, be a base, or give its constants, static and class methods; held in a variable, an attribute
        assignment could change it for everyone (``T = torch.Tensor; T.sum = f``), and an instance method of the
        program's reached through it could be called with a foreign object as ``self``."""
        label = _dotted(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            if isinstance(node, ast.Name) and node.id in self.facts.classes | {self._receiver_name(node)} \
                    and parent.attr in self.facts.instance_methods:
                self.refuse(node, f"{label}.{parent.attr} reaches an instance method through the class; call it "
                                  f"on an object instead (obj.{parent.attr}(...))")
            return
        if isinstance(parent, ast.Tuple):
            parent = self._parent(parent)
        allowed = (isinstance(parent, ast.Call) and (parent.func is node or _is_call_of(parent, "isinstance",
                                                                                        "issubclass"))) \
            or (isinstance(parent, ast.ClassDef) and node in parent.bases) \
            or (isinstance(parent, ast.FunctionDef) and node in parent.decorator_list) \
            or isinstance(parent, (ast.Compare, ast.Raise, ast.ExceptHandler))
        if not allowed:
            self.refuse(node, f"the class {label} may only be called, tested with isinstance(), used as a base "
                              f"or for its constants and static methods")

    def _receiver_name(self, node: ast.AST) -> str | None:
        found = self.facts.method_of(node)
        return found[1] if found is not None and found[2] == "cls" else None

    def _arg(self, node: ast.arg) -> None:
        if node.arg in self.facts.imported:
            self.refuse(node, f"{node.arg!r} is an imported name; name the parameter differently")

    def _ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name in self.facts.imported:
            self.refuse(node, f"{node.name!r} is an imported name; name the exception differently")

    # -- attributes -----------------------------------------------------------------------------------------
    def _Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        root = _root(node)
        from_module = isinstance(root, ast.Name) and root.id in self.facts.modules
        if problem := attribute_problem(name):
            self.refuse(node, problem)
        elif name.startswith("_") and not _is_dunder(name) and not from_module and not self._on_receiver(node):
            self.refuse(node, f"the private attribute {_dotted(node)} is not allowed; private attributes are "
                              f"only for your own objects (self._name)")
        if not isinstance(node.ctx, ast.Load):
            self._store(node)
        parent = self._parent(node)
        if from_module and not (isinstance(parent, ast.Attribute) and parent.value is node):
            self._chain(node, root.id)

    def _on_receiver(self, node: ast.Attribute) -> bool:
        found = self.facts.method_of(node)
        return found is not None and isinstance(node.value, ast.Name) and node.value.id == found[1]

    def _store(self, node: ast.Attribute) -> None:
        found = self.facts.method_of(node)
        base = node.value
        if node.attr in TENSOR_STORES and isinstance(base, ast.Name) and base.id not in self.facts.imported \
                and base.id not in self.facts.classes and base.id != self._receiver_name(node):
            return  # a tensor's data or gradient (classes never reach a variable: see _class_use)
        if found is None or not isinstance(base, ast.Name) or base.id != found[1] \
                or self.facts.rebinds(found[0], base.id):
            self.refuse(node, f"assigning or deleting {_dotted(node)} is not allowed: a program assigns only "
                              f"attributes of self, inside its own classes' methods (self.name = value); keep "
                              f"other state in dicts")

    def _chain(self, node: ast.Attribute, root: str) -> None:
        """Resolve ``root.a.b...`` against the real modules: refused where it reaches a module that is not
        allowed or a private member; a chain ending on an allowed module must be followed by ``.name``."""
        names = []
        current: ast.AST = node
        while isinstance(current, ast.Attribute):
            names.append(current.attr)
            current = current.value
        value: Any = self.facts.modules[root]
        for name in reversed(names):
            if isinstance(value, types.ModuleType):
                value, why = member(value, name)
                if why:
                    self.refuse(node, why)
                    return
                continue
            value = static_member(value, name)
            if value is _MISSING:
                return
            if isinstance(value, types.ModuleType):
                self.refuse(node, f"{_dotted(node)} reaches the module {value.__name__!r}, which a program may "
                                  f"not reach")
                return
        if isinstance(value, types.ModuleType):
            self.refuse(node, f"{_dotted(node)}: {MODULE_HINT}")
        elif isinstance(value, type):
            self._class_use(node, self._parent(node))

    def _Subscript(self, node: ast.Subscript) -> None:
        root = _root(node)
        if not isinstance(node.ctx, ast.Load) and isinstance(root, ast.Name) and root.id in self.facts.imported:
            self.refuse(node, f"changing what {root.id} holds is not allowed; keep your own state in your objects")

    # -- calls ----------------------------------------------------------------------------------------------
    def _Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr"):
            self._getattr(node, func.id)
        elif isinstance(func, ast.Name) and func.id == "type":
            self._type(node)
        elif isinstance(func, ast.Name) and func.id == "super" and (node.args or node.keywords):
            self.refuse(node, "super() takes no arguments in a program; write super().method(...)")
        elif isinstance(func, ast.Attribute) and func.attr in ("format", "format_map"):
            literal = func.value
            if not (isinstance(literal, ast.Constant) and isinstance(literal.value, str)):
                self.refuse(node, f".{func.attr}() is only allowed on a literal string; use an f-string")
            elif problem := format_fields_problem(literal.value):
                self.refuse(node, problem)

    def _getattr(self, node: ast.Call, name: str) -> None:
        attribute = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(attribute, ast.Constant) and isinstance(attribute.value, str)
                and not attribute.value.startswith("_")):
            self.refuse(node, f"{name}() needs a literal attribute name that does not start with '_'")
        elif problem := attribute_problem(attribute.value):
            self.refuse(node, f"{name}(..., {attribute.value!r}): {problem}")
        elif attribute.value in self.facts.instance_methods and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in self.facts.classes:
            self.refuse(node, f"{name}() of an instance method through the class is not allowed")

    def _type(self, node: ast.Call) -> None:
        if len(node.args) != 1 or node.keywords:
            self.refuse(node, "type() with more than one argument builds classes; write a class statement")
            return
        parent = self._parent(node)
        if isinstance(parent, ast.Attribute) and parent.value is node and parent.attr == "__name__":
            return
        if isinstance(parent, ast.Tuple):
            parent = self._parent(parent)
        if isinstance(parent, ast.Compare) or (isinstance(parent, ast.Call) and _is_call_of(parent, "isinstance",
                                                                                             "issubclass")):
            return
        self.refuse(node, "type(x) may only be compared, used in isinstance() or read as type(x).__name__")

    # -- definitions and statements -------------------------------------------------------------------------
    def _FunctionDef(self, node: ast.FunctionDef) -> None:
        if _is_dunder(node.name) and node.name not in DUNDER_METHODS:
            self.refuse(node, f"defining {node.name} is not allowed (a program's classes may define "
                              f"{', '.join(sorted(DUNDER_METHODS))}); write an ordinary method")

    def _ClassDef(self, node: ast.ClassDef) -> None:
        if node.keywords:
            self.refuse(node, f"class {node.name}: keywords (metaclass=...) are not allowed")
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if name not in CLASS_DECORATORS:
                self.refuse(node, f"class {node.name}: only {', '.join(sorted(CLASS_DECORATORS))} may decorate "
                                  f"a class")

    def _Global(self, node: ast.Global) -> None:
        self.refuse(node, "the global statement is not allowed; keep state on your object")

    def _AsyncFunctionDef(self, node: ast.AST) -> None:
        self.refuse(node, "async code is not allowed")

    _Await = _AsyncFor = _AsyncWith = _AsyncFunctionDef

    def _Match(self, node: ast.Match) -> None:
        self.refuse(node, "match statements are not allowed (class patterns read attributes); use if/elif")


def _is_call_of(node: ast.Call, *names: str) -> bool:
    return isinstance(node.func, ast.Name) and node.func.id in names


def check_source(source: str, filename: str) -> list[str]:
    """Every reason to refuse ``source`` (empty when it passes), each naming the file and the line."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as error:
        return [f"{filename} line {error.lineno}: syntax error: {error.msg}"]
    except ValueError as error:  # a null byte, say
        return [f"{filename}: the program cannot be parsed ({error})"]
    checker = _Checker(_Facts(tree))
    for node in ast.walk(tree):
        checker.check(node)
    seen: set[tuple[int, str]] = set()
    problems = []
    for line, text in sorted(checker.problems, key=lambda item: item[0]):
        if (line, text) not in seen:
            seen.add((line, text))
            problems.append(f"{filename} line {line or '?'}: {text}")
    return problems
