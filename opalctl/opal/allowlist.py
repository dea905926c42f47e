"""The static check of an agent's program: a lint on its syntax tree, run before any of the program's code runs,
that refuses mistakes and the known tricks early, each with one sentence an honest agent can act on.

It is a lint, not the boundary. Assume every program runs arbitrary Python with the training process's rights:
Python has more routes from a value to the interpreter's internals than a check of the source can name. What
holds a program in is elsewhere: the operating system's confinement of the training process, and the evaluator
process that alone loads evaluation data and judges results (see docs/architecture.md); the guards of
``guard.py`` contain what a program's calls do (exceptions, time limits, torch's global settings).

What a program may use:

- the modules in ``MODULES`` (torch's tensor math, ``math`` and a few pure standard-library modules), imported
  with ``import``/``from ... import``; a name bound to a module may only be followed by ``.name``, and every
  dotted chain from it is resolved against the real modules (without importing anything but allowed modules):
  a chain that reaches any other module (``torch.os``, ``typing.sys``, ``torch.nn.functional.np``,
  ``torch.serialization``) or a private member (``torch._C``; ``torch._foreach_*`` excepted) is refused;
- of the standard-library modules, only the names listed for each in ``MODULES`` (not ``functools.wraps``: its
  ``updated=("__globals__",)`` copies torch's module globals, ``os`` and ``sys`` among them, into the program's);
- the builtins in ``BUILTINS``; every other builtin name is refused wherever it appears, and the names the check
  itself relies on (``isinstance``, ``type``, ``property``, ``staticmethod``, ``dataclass``, ...) are never bound;
- its own state: attributes are assigned (or deleted) only as ``self.name`` inside the methods of its own
  classes; a method's receiver (``self``, a classmethod's ``cls``) is never bound again inside it (by assignment,
  walrus, loop, ``with``/``except ... as``, a comprehension, a nested parameter, ``del``, an import or a ``def``),
  a method's decorators keep it a method (``property``, ``staticmethod``, ``classmethod``, ``functools.cache``,
  ``torch.no_grad()``, ...) and it is never rebound in the class body (``m = staticmethod(m)``), so ``self`` is
  always the program's own object; its classes are used to build objects, in ``isinstance``, as bases, or for
  their constants, static and class methods (never to call an instance method on a foreign object).

Refused as members of a module: torch's global settings (``torch.set_num_threads``, ``torch.manual_seed``,
``torch.default_generator``, every ``set_*`` but ``set_grad_enabled``), and what hands a program a module or
copies attributes by name (``REFUSED_MEMBERS``: ``torch.get_device_module``, ``functools.wraps``).

Refused everywhere, whatever the object: dunder attributes and names (``__init__``/``__name__`` excepted), frame,
code and traceback attributes (``f_locals``, ``gi_frame``, ``tb_frame``, ...), anything named like a hook, files
and processes (``save``, ``load``, ``tofile``, ``dump``, ``numpy``, ...), an AttributeError's ``.obj`` (the object
a library looked the name up on: ``storage.type("os")`` fails on the module ``os``), ABC ``.register``, private
attributes (``_name``) at any step of a chain but on ``self`` and then only those the program's own classes set or
define (``torch.Tensor._make_subclass``, ``x._version``, ``self.p._base`` and an inherited ``self._apply`` are
refused), ``getattr``/``hasattr`` other than called with a literal name, attribute assignments other than
``self.name`` (and a tensor's ``.data``/``.grad``), ``str.format`` other than on a literal whose fields reach no
attribute, ``.type(...)`` with anything but a dtype written out (given a string, torch imports the module it
names: ``storage.type("os.system")``), ``.format``/``.type`` held instead of called, the functional ``Enum``
API (``Enum("E", {...})`` names class attributes by data, dunder methods included), and defining dunder methods
beyond a few harmless ones (our code formats and compares what a program returns: a ``__str__`` or ``__float__``
of its own would run outside its time limit).

Strings: a string or bytes constant (an f-string's literal parts, a keyword argument's name, a class's name) that
holds a word shaped like a dunder (``"__globals__"``, ``b"__class__"``, ``"a,__str__"``; ``__init__`` and
``__name__`` excepted) or like a frame, code or traceback attribute (``"f_globals"``,
``"tb_frame"``: the real attribute names, so ``"f_score"`` passes), or that makes one once its template fields
are filled (``"__{}__"``, ``"__%s__"``, ``f"__{name}__"``), is refused wherever it appears: such words are the
data a function given attribute names (``update_wrapper``, ``getattr``, an ``Enum`` built from a dict) turns into
a reach into internals, and honest text has no use for them. Docstrings and other bare string statements are
prose and pass. Private-looking strings (``"_count"``) pass: they are ordinary dict keys, and the places where a
string names an attribute refuse them there (``getattr``/``hasattr`` with a name that starts with ``_``;
``namedtuple`` refuses such field names itself; ``wraps`` and the functional ``Enum`` are refused outright).

What it does not stop (the layers above do, or nothing does): strings computed at run time
(``"_" * 2 + "globals" + "_" * 2``, ``chr(95)``) handed to any function that takes attribute or module names as
data, allowed today or in a later torch; values the check cannot follow (it reads names and literals, not what a
call returns or what a variable holds, so a storage kept under the name ``device`` passes as ``x.device.type``,
and a torch function that hands back an internal object is as good as the object); mutable tables of torch's own
held in a variable; anything torch or the optimizer it is handed does when called; and CPU, memory and time
(the guards' limits and the watchdog).
"""

from __future__ import annotations

import ast
import builtins
import enum
import importlib
import inspect
import re
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
    "functools": frozenset({"partial", "reduce", "lru_cache", "cache", "cached_property", "total_ordering",
                            "cmp_to_key"}),
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
_COPIES_BY_NAME = ("it copies attributes named as data from one object onto another (updated=('__globals__',) copies "
                   "torch's module globals, os and sys among them, into your program's); write the wrapper as a "
                   "plain function without it")
# module members refused with a sentence of their own (checked before the lists of MODULES)
REFUSED_MEMBERS = {
    "functools.wraps": _COPIES_BY_NAME,
    "functools.update_wrapper": _COPIES_BY_NAME,
    "torch.get_device_module": ("it returns a module (torch.cuda, torch.cpu), which a program may not hold; use "
                                "tensor.device and tensor methods"),
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
    "obj": ("an AttributeError's .obj is the object a library looked the name up on (a module, say) and is not "
            "allowed; read str(error), and give an attribute of your own another name"),
    "register": ("registering a class with an abstract base class (numbers.Real.register) changes what "
                 "isinstance() answers in the whole process and is not allowed; test your own types instead"),
}
# members of a module (not of an object: a torch.Generator of the program's own may be seeded) that change
# torch's global settings; so does every module member named set_* but set_grad_enabled
GLOBAL_SETTINGS = frozenset({"manual_seed", "seed", "set_rng_state", "use_deterministic_algorithms",
                             "default_generator"})
# attribute prefixes that reach frames, code objects and tracebacks (and through them every caller's locals)
FRAME_PREFIXES = ("f_", "gi_", "cr_", "ag_", "tb_", "co_")
# the real attributes of those kinds, read from the interpreter: a string is held to these, not to the prefixes
FRAME_ATTRIBUTES = frozenset(
    name for kind in (types.FrameType, types.CodeType, types.GeneratorType, types.CoroutineType,
                      types.AsyncGeneratorType, types.TracebackType)
    for name in dir(kind) if name.startswith(FRAME_PREFIXES))
DUNDER_ATTRIBUTES = frozenset({"__init__", "__name__"})
DUNDER_METHODS = frozenset({"__init__", "__call__", "__post_init__"})  # what a program's classes may define
CLASS_DECORATORS = frozenset({"dataclass", "total_ordering"})
# what a method may be decorated with, besides @name.setter/.getter/.deleter of a property of its class: each keeps
# the first parameter the object (or class) the method is called on
RECEIVER_DECORATORS = frozenset({"property", "staticmethod", "classmethod"})
METHOD_DECORATORS = ("functools.cache", "functools.lru_cache", "functools.cached_property", "torch.no_grad",
                     "torch.enable_grad", "torch.set_grad_enabled")
# names the check trusts to mean the builtin (or the allowed decorator): a program never binds them
RELIED_ON_NAMES = frozenset({"isinstance", "issubclass", "type", "super", "getattr", "hasattr"}
                            | RECEIVER_DECORATORS | CLASS_DECORATORS)
# methods whose calls the check reads (their arguments, or the literal they are called on): only called in place
CALL_CHECKED_METHODS = frozenset({"type", "format", "format_map"})
TENSOR_STORES = frozenset({"data", "grad"})  # assignable on a tensor held in a variable (p.data = ..., p.grad = None)
MODULE_HINT = "a module may only be used as module.name; import what you need (import torch.nn as nn)"
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# a str.format field or a %-conversion: filled, it can complete a name ("__{}__".format("globals"))
TEMPLATE_FIELD = re.compile(r"\{[^{}]*\}|%(?:\([^)]*\))?[-#0 +]*[0-9*]*(?:\.[0-9*]+)?[a-zA-Z]")


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _dunder_shaped(word: str) -> bool:
    """A word that names a dunder: ``__x__`` with something between the underscores (``____`` is a rule)."""
    return len(word) > 4 and _is_dunder(word) and word.strip("_") != ""


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


def _internal_word(text: str) -> str | None:
    """The first word of ``text`` shaped like the name of an interpreter internal (None when there is none)."""
    for word in IDENTIFIER.findall(text):
        if (_dunder_shaped(word) and word not in DUNDER_ATTRIBUTES) or word in FRAME_ATTRIBUTES:
            return word
    return None


def text_problem(text: str, what: str = "the string") -> str | None:
    """Why a string constant (or a name the program writes) is refused: it holds a word shaped like a dunder or a
    frame, code or traceback attribute, as written or once its template fields are filled (None when not)."""
    shown = repr(text if len(text) <= 60 else text[:57] + "...")
    if word := _internal_word(text):
        named = "names an interpreter internal" if word == text else f"holds {word!r}, the name of an interpreter internal"
        return f"{what} {shown} {named}; such words are refused wherever they appear, strings included (reword it)"
    if word := _internal_word(TEMPLATE_FIELD.sub("x", text)):
        return (f"{what} {shown} is a template that makes a name shaped like an interpreter internal ({word!r} "
                f"with its fields filled by x); build no such names")
    return None


def resolve_import(dotted: str) -> types.ModuleType | None:
    """The allowed module ``dotted`` (imported if need be), or None when it is not allowed."""
    return importlib.import_module(dotted) if dotted in MODULES else None


def member(module: types.ModuleType, name: str) -> tuple[Any, str | None]:
    """``module.name`` as the program would reach it, found without running any lazy import: (the value, None),
    or (None, why it is refused)."""
    dotted = f"{module.__name__}.{name}"
    if dotted in REFUSED_MEMBERS:
        return None, f"{dotted} is not allowed: {REFUSED_MEMBERS[dotted]}"
    allowed = MODULES[module.__name__]
    if allowed is not None and name not in allowed:
        return None, f"{dotted} is not available to a program (allowed: {', '.join(sorted(allowed))})"
    if name in GLOBAL_SETTINGS or (name.startswith("set_") and name != "set_grad_enabled"):
        return None, f"{dotted}: {_GLOBAL_STATE}"
    if name.startswith("_") and not name.startswith("_foreach_"):
        return None, f"{dotted} is private to torch and is not allowed"
    if dotted in MODULES:
        return importlib.import_module(dotted), None
    value = vars(module).get(name, _MISSING)
    if value is _MISSING:
        return None, f"{module.__name__} has no attribute {name!r} a program may use"
    if isinstance(value, types.ModuleType):
        return None, (f"{dotted} is the module {value.__name__!r}, which a program may not reach "
                      f"(allowed modules: {', '.join(MODULES)})")
    return value, None


def static_member(value: Any, name: str) -> Any:
    """``value.name`` found statically on a class or function (``_MISSING`` when it cannot be told)."""
    try:
        return inspect.getattr_static(value, name)
    except AttributeError:
        return _MISSING


_MISSING = object()


def resolve_dotted(dotted: str) -> Any:
    """The object an allowed dotted name (``torch.no_grad``) names, through ``member`` (``_MISSING`` if refused)."""
    module_name, _, name = dotted.rpartition(".")
    value, why = member(importlib.import_module(module_name), name)
    return _MISSING if why else value


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
    or to a member of one), its classes (their methods and which of those are instance methods), the ``self`` and
    ``cls`` parameters of their methods, and every attribute name its own code defines in a class body or sets on
    a method's receiver."""

    def __init__(self, tree: ast.Module):
        self.parents: dict[ast.AST, ast.AST] = {}
        self.modules: dict[str, types.ModuleType] = {}  # name -> the allowed module it is bound to
        self.imported: set[str] = set()  # every name an import binds
        self.imported_values: dict[str, Any] = {}  # name -> the module member an import binds it to
        self.imported_classes: set[str] = set()  # names an import binds to a class (from torch import Tensor)
        self.classes: dict[str, ast.ClassDef] = {}
        self.methods: dict[ast.ClassDef, set[str]] = {}  # class -> the names its body defines with def
        self.instance_methods: set[str] = set()
        self.receivers: dict[ast.AST, tuple[str, str]] = {}  # method -> (first parameter, "self" or "cls")
        self.receiver_parameters: set[ast.arg] = set()
        self.own_attributes: set[str] = set()  # names the program's classes define, or set on self/cls
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
                    self._bind_from(node, alias)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load) and self.on_receiver(node):
                self.own_attributes.add(node.attr)

    def _bind_import(self, alias: ast.alias) -> None:
        bound = alias.asname or alias.name.split(".")[0]
        self.imported.add(bound)
        target = alias.name if alias.asname else alias.name.split(".")[0]
        module = resolve_import(target)
        if module is not None:
            self.modules[bound] = module

    def _bind_from(self, node: ast.ImportFrom, alias: ast.alias) -> None:
        bound = alias.asname or alias.name
        self.imported.add(bound)
        module = resolve_import(node.module or "") if not node.level else None
        if module is None or alias.name == "*":
            return
        value, why = member(module, alias.name)
        if why:
            return
        self.imported_values[bound] = value
        if isinstance(value, types.ModuleType):
            self.modules[bound] = value
        elif isinstance(value, type):
            self.imported_classes.add(bound)

    def _class(self, node: ast.ClassDef) -> None:
        self.classes[node.name] = node
        self.methods[node] = set()
        for item in node.body:
            targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
            self.own_attributes.update(t.id for t in targets if isinstance(t, ast.Name))
            if not isinstance(item, ast.FunctionDef):
                continue
            self.methods[node].add(item.name)
            self.own_attributes.add(item.name)
            parameters = item.args.posonlyargs + item.args.args  # def m(self, /, x): self is positional-only
            decorators = {d.id for d in item.decorator_list if isinstance(d, ast.Name)}
            if not parameters or "staticmethod" in decorators:
                continue
            kind = "cls" if "classmethod" in decorators else "self"
            if kind == "self" and "property" not in decorators:
                self.instance_methods.add(item.name)
            self.receivers[item] = (parameters[0].arg, kind)
            self.receiver_parameters.add(parameters[0])

    def method_of(self, node: ast.AST) -> tuple[ast.FunctionDef, str, str] | None:
        """The method of one of the program's classes whose body holds ``node`` (its receiver and kind)."""
        while node in self.parents:
            node = self.parents[node]
            if node in self.receivers:
                name, kind = self.receivers[node]
                return node, name, kind
        return None

    def on_receiver(self, node: ast.Attribute) -> bool:
        """Whether ``node`` is ``self.name`` (or ``cls.name``) on the receiver of the method that holds it."""
        found = self.method_of(node)
        return found is not None and isinstance(node.value, ast.Name) and node.value.id == found[1]

    def class_body_of(self, node: ast.AST) -> ast.ClassDef | None:
        """The class whose body (not one of its methods) holds ``node``."""
        while node in self.parents:
            node = self.parents[node]
            if isinstance(node, ast.ClassDef):
                return node
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ListComp, ast.SetComp,
                                 ast.DictComp, ast.GeneratorExp)):
                return None
        return None

    def value_of(self, node: ast.AST) -> Any:
        """The real object a name or dotted chain of the program stands for, when the imports tell it: a module,
        a module's member, or a member of one found statically (``_MISSING`` otherwise)."""
        if isinstance(node, ast.Name):
            return self.modules.get(node.id, self.imported_values.get(node.id, _MISSING))
        if not isinstance(node, ast.Attribute):
            return _MISSING
        owner = self.value_of(node.value)
        if owner is _MISSING:
            return _MISSING
        if isinstance(owner, types.ModuleType):
            value, why = member(owner, node.attr)
            return _MISSING if why else value
        return static_member(owner, node.attr)


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

    def _called(self, node: ast.expr) -> bool:
        parent = self._parent(node)
        return isinstance(parent, ast.Call) and parent.func is node

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

    def _alias(self, node: ast.alias) -> None:
        parent = self._parent(node)
        if node.name == "*":
            return
        if isinstance(parent, ast.Import):
            self._bind(node, node.asname or node.name.split(".")[0], relied_on=True)
        else:  # from dataclasses import dataclass binds the very name the check relies on: only a rename is refused
            self._bind(node, node.asname or node.name, relied_on=node.asname not in (None, node.name))

    # -- names and what binds them --------------------------------------------------------------------------
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
            self._bind(node, name)
            return
        parent = self._parent(node)
        if name in self.facts.modules and not (isinstance(parent, ast.Attribute) and parent.value is node):
            self.refuse(node, f"{name}: {MODULE_HINT}")
        elif name in ("getattr", "hasattr") and not self._called(node):
            self.refuse(node, f"{name} may only be called directly, with a literal attribute name")
        elif name in self.facts.classes or name in self.facts.imported_classes or self._is_class_receiver(node):
            self._class_use(node, parent)

    def _bind(self, node: ast.AST, name: str, *, relied_on: bool = True) -> None:
        """``name`` is bound at ``node`` (by assignment, ``del``, a loop, ``with``/``except ... as``, a parameter,
        an import, a ``def`` or a ``class``): refused where it is the receiver of the method that holds it (then
        ``self.x = ...`` would assign on whatever it was rebound to), a name the check relies on, or a method of
        the class whose body rebinds it (``m = staticmethod(m)`` turns the method's ``self`` into any argument)."""
        found = self.facts.method_of(node)
        if found is not None and name == found[1] and node not in self.facts.receiver_parameters:
            self.refuse(node, f"rebinding {name!r} inside a method is not allowed: {name} must stay the object the "
                              f"method was called on; use another name")
        if relied_on and name in RELIED_ON_NAMES:
            self.refuse(node, f"{name!r} is a name the check relies on (a builtin or an allowed decorator); do not "
                              f"bind it, use a name of your own")
        cls = self.facts.class_body_of(node)
        if cls is not None and name in self.facts.methods[cls] and not isinstance(node, ast.FunctionDef):
            self.refuse(node, f"rebinding the method {name!r} in the class body is not allowed; define it once, with "
                              f"its decorator (@staticmethod, @property, ...)")

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
            if isinstance(node, ast.Name) and node.id in set(self.facts.classes) | {self._receiver_name(node)} \
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
        if problem := text_problem(node.arg, "the parameter name"):
            self.refuse(node, problem)
        self._bind(node, node.arg)

    def _ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name in self.facts.imported:
            self.refuse(node, f"{node.name!r} is an imported name; name the exception differently")
        if node.name:
            self._bind(node, node.name)

    # -- strings --------------------------------------------------------------------------------------------
    def _Constant(self, node: ast.Constant) -> None:
        if isinstance(self._parent(node), (ast.Expr, ast.JoinedStr)):
            return  # a docstring or bare string statement is prose; an f-string's parts are read by _JoinedStr
        if isinstance(node.value, (str, bytes)):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            if problem := text_problem(text):
                self.refuse(node, problem)

    def _JoinedStr(self, node: ast.JoinedStr) -> None:
        if isinstance(self._parent(node), ast.Expr):
            return
        text = "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
        if problem := text_problem(text):
            self.refuse(node, problem)

    def _keyword(self, node: ast.keyword) -> None:
        if node.arg is not None and (problem := text_problem(node.arg, "the keyword argument name")):
            self.refuse(node, problem)

    # -- attributes -----------------------------------------------------------------------------------------
    def _Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        root = _root(node)
        from_module = isinstance(root, ast.Name) and root.id in self.facts.modules
        if problem := attribute_problem(name):
            self.refuse(node, problem)
        elif name.startswith("_") and not _is_dunder(name) \
                and not isinstance(self.facts.value_of(node.value), types.ModuleType):
            self._private(node)  # a module's private members are refused (or let through) by member()
        if name in CALL_CHECKED_METHODS and isinstance(node.ctx, ast.Load) and not self._called(node) \
                and not self._device_type(node) \
                and not (self.facts.on_receiver(node) and name in self.facts.own_attributes):
            self.refuse(node, f".{name} may only be called where it is written (x.{name}(...)), so that its "
                              f"arguments can be checked; do not hold it or pass it on")
        if not isinstance(node.ctx, ast.Load):
            self._store(node)
        parent = self._parent(node)
        if from_module and not (isinstance(parent, ast.Attribute) and parent.value is node):
            self._chain(node, root.id)

    def _private(self, node: ast.Attribute) -> None:
        """A private attribute anywhere but on a module: allowed on the method's own receiver, for the names the
        program's classes set or define; not on anything else, at any step of a chain (``torch.Tensor._x``,
        ``x.a._b.c``, ``self.p._base``)."""
        if not self.facts.on_receiver(node):
            self.refuse(node, f"the private attribute {_dotted(node)} is not allowed; private attributes are "
                              f"only for your own objects (self._name)")
        elif node.attr not in self.facts.own_attributes:
            self.refuse(node, f"{_dotted(node)}: your classes never set or define {node.attr}, so it is a private "
                              f"member of a class they inherit from (torch's, say), which is not allowed; name your "
                              f"own attributes (self._name = ...)")

    def _device_type(self, node: ast.Attribute) -> bool:
        """``x.device.type`` (a device's kind, a string), or ``.type`` read in a comparison or an f-string."""
        parent = self._parent(node)
        return node.attr == "type" and ((isinstance(node.value, ast.Attribute) and node.value.attr == "device")
                                        or isinstance(parent, (ast.Compare, ast.FormattedValue)))

    def _store(self, node: ast.Attribute) -> None:
        base = node.value
        if node.attr in TENSOR_STORES and isinstance(base, ast.Name) and base.id not in self.facts.imported \
                and base.id not in self.facts.classes and base.id != self._receiver_name(node):
            return  # a tensor's data or gradient (classes never reach a variable: see _class_use)
        if not self.facts.on_receiver(node):  # the receiver is never rebound: see _bind
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
        elif isinstance(func, ast.Attribute) and func.attr == "type":
            self._type_method(node)
        building = len(node.args) > 1 or any(k.arg != "value" for k in node.keywords)  # Color(value=1) looks up
        if building and self._is_enum(func, set()):
            self.refuse(node, f"{_dotted(func)}('Name', ...) builds an Enum from data (its names can be dunder "
                              f"methods); write a class statement instead (class Color(Enum): RED = 1)")

    def _getattr(self, node: ast.Call, name: str) -> None:
        attribute = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(attribute, ast.Constant) and isinstance(attribute.value, str)
                and not attribute.value.startswith("_")):
            self.refuse(node, f"{name}() needs a literal attribute name that does not start with '_'")
        elif problem := attribute_problem(attribute.value):
            self.refuse(node, f"{name}(..., {attribute.value!r}): {problem}")
        elif name == "getattr" and attribute.value in CALL_CHECKED_METHODS:
            self.refuse(node, f"getattr(..., {attribute.value!r}) hides a call the check reads; write "
                              f"x.{attribute.value}(...) where you call it")
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

    def _type_method(self, node: ast.Call) -> None:
        """``x.type()`` or ``x.type(torch.float32)``: given a string (or anything the check cannot tell is a
        dtype), a storage's ``.type`` imports the module the string names (``storage.type("os.system")``)."""
        given = list(node.args) + [k.value for k in node.keywords if k.arg in (None, "dtype")]
        if not given:
            return
        torch_dtype = importlib.import_module("torch").dtype
        if len(given) == 1 and isinstance(self.facts.value_of(given[0]), torch_dtype):
            return
        self.refuse(node, ".type() takes only a dtype written out (x.type(torch.float32)) or nothing: given a "
                          "string, torch imports the module it names; for a dtype held in a variable write x.to(dtype)")

    def _is_enum(self, node: ast.expr, seen: set[str]) -> bool:
        """Whether ``node`` names an Enum class: enum's own, or one of the program's built on one (its ``cls``)."""
        value = self.facts.value_of(node)
        if isinstance(value, type):
            return issubclass(value, enum.Enum)
        if not isinstance(node, ast.Name) or node.id in seen:
            return False
        cls = self.facts.classes.get(node.id)
        if cls is None and self._is_class_receiver(node):
            cls = self._parent(self.facts.method_of(node)[0])
        seen.add(node.id)
        return isinstance(cls, ast.ClassDef) and any(self._is_enum(base, seen) for base in cls.bases)

    # -- definitions and statements -------------------------------------------------------------------------
    def _FunctionDef(self, node: ast.FunctionDef) -> None:
        if _is_dunder(node.name) and node.name not in DUNDER_METHODS:
            self.refuse(node, f"defining {node.name} is not allowed (a program's classes may define "
                              f"{', '.join(sorted(DUNDER_METHODS))}); write an ordinary method")
        elif not _is_dunder(node.name) and (problem := text_problem(node.name, "the function name")):
            self.refuse(node, problem)
        self._bind(node, node.name)
        cls = self._parent(node)
        if isinstance(cls, ast.ClassDef):
            for decorator in node.decorator_list:
                if not self._keeps_receiver(decorator, cls):
                    self.refuse(node, f"the method {node.name} may only be decorated with property, staticmethod, "
                                      f"classmethod, a property's .setter, functools.cache, lru_cache or "
                                      f"cached_property, or torch.no_grad()/enable_grad()/set_grad_enabled(); a "
                                      f"decorator of your own could turn self into any argument")

    def _keeps_receiver(self, decorator: ast.expr, cls: ast.ClassDef) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name) and target.id in RECEIVER_DECORATORS:
            return True  # the builtins themselves: a program never binds these names (see _bind)
        if isinstance(target, ast.Attribute) and target.attr in ("setter", "getter", "deleter") \
                and isinstance(target.value, ast.Name) and target.value.id in self.facts.methods[cls]:
            return True
        value = self.facts.value_of(target)
        return value is not _MISSING and any(value is resolve_dotted(name) for name in METHOD_DECORATORS)

    def _ClassDef(self, node: ast.ClassDef) -> None:
        if node.keywords:
            self.refuse(node, f"class {node.name}: keywords (metaclass=...) are not allowed")
        if problem := text_problem(node.name, "the class name"):
            self.refuse(node, problem)
        self._bind(node, node.name)
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
