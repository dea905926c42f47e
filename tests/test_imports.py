"""How opalctl's modules import each other, read statically (``ast``) from the source: no import cycle among them,
and no import inside a function but one that keeps a heavy package out of start-up (``opalctl --help`` imports
none of them).

An import inside a function hides a cycle (two modules each needing the other) and makes a module's dependencies
hard to see; the one reason kept for it is start-up time: torch and the other packages in ``HEAVY`` take seconds
to import, and ``opalctl --help`` must not wait for them. A module is heavy when its top-level imports reach one
of them, directly or through other modules of opalctl (importing ``a.b.c`` runs ``a`` and ``a.b`` too).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import opalctl

PACKAGE = Path(opalctl.__file__).resolve().parent
# what start-up leaves out: the machine-learning stack, the trackers, the agent SDK, the statistics and plotting
# stack, the protocol's validation (pydantic) and the Slurm client (submitit, with asyncio: half a second)
HEAVY = frozenset({"torch", "transformers", "lightning", "wandb", "mlflow", "anthropic", "scipy", "matplotlib",
                   "numpy", "sklearn", "pydantic", "submitit"})



class Modules:
    """Every module of opalctl with its imports: at the top level (run when it is imported) and in functions."""

    def __init__(self, root: Path = PACKAGE):
        self.files: dict[str, Path] = {}
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.top: dict[str, list[ast.stmt]] = {}
        self.inner: dict[str, list[ast.stmt]] = {}
        for name in self.files:
            self.top[name], self.inner[name] = self._imports(name)
        self._heavy: dict[str, frozenset[str]] = {}

    def _imports(self, name: str) -> tuple[list[ast.stmt], list[ast.stmt]]:
        top: list[ast.stmt] = []
        inner: list[ast.stmt] = []

        def walk(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue  # for the type checker alone: never run
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    (inner if in_function else top).append(child)
                walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        walk(ast.parse(self.files[name].read_text(encoding="utf-8")), False)
        return top, inner

    def targets(self, name: str, node: ast.stmt) -> list[str]:
        """The modules an import statement names (``from a import b`` names ``a.b`` when that is a module)."""
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            package = name.split(".") if self.files[name].name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.files else base for alias in node.names]

    def runs(self, name: str, node: ast.stmt) -> set[str]:
        """What importing runs: each module named and the packages above it, but those ``name`` itself lies in."""
        out = set()
        for target in self.targets(name, node):
            parts = target.split(".")
            for end in range(1, len(parts) + 1):
                module = ".".join(parts[:end])
                if module == target or not (name == module or name.startswith(module + ".")):
                    out.add(module)
        return out - {name}

    def graph(self) -> dict[str, set[str]]:
        """Each module of opalctl -> the modules of opalctl its top-level imports run."""
        return {name: {m for node in self.top[name] for m in self.runs(name, node) if m in self.files}
                for name in self.files}

    def heavy(self, module: str) -> frozenset[str]:
        """The packages of ``HEAVY`` that importing ``module`` imports (empty: it is light)."""
        if module not in self.files:
            return frozenset({module.split(".")[0]}) & HEAVY
        if module not in self._heavy:
            self._heavy[module] = frozenset()  # a cycle adds nothing the modules in it do not import themselves
            self._heavy[module] = frozenset().union(*(self.heavy(m) for node in self.top[module]
                                                      for m in self.runs(module, node)))
        return self._heavy[module]

    def where(self, name: str, node: ast.stmt) -> str:
        return f"{self.files[name].relative_to(PACKAGE.parent).as_posix()}: {ast.unparse(node)}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of ``graph`` as one path through it (Tarjan's strongly connected components, then a path)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(_path_through(sorted(component), graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle inside a strongly connected component, from its first module back to it."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for other in sorted(graph[node] & inside):
            if other == start:
                return paths[node] + [start]
            if other not in paths:
                paths[other] = paths[node] + [other]
                queue.append(other)
    return component


def test_no_module_of_opalctl_imports_itself_back_through_others():
    found = cycles(Modules().graph())
    assert found == [], "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in found)


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The command line is the one module whose light imports stay in functions: each command imports the module that
# does its work when it runs. Every `opalctl` process (a formal run starts several: the run, its evaluator, the grid's
# children) would otherwise import all of opalctl first: 77 modules and 0.24 CPU-s more per process, measured.
COMMAND_LINE = "opalctl.cli"


def test_every_import_inside_a_function_keeps_a_heavy_package_out_of_start_up():
    """Kept inside a function only when the module imported brings a heavy package that the importing module's own
    top level does not (a module that imports pydantic already gains nothing by importing the schema late)."""
    modules = Modules()
    light = [modules.where(name, node) for name in modules.files if name != COMMAND_LINE
             for node in modules.inner[name]
             if all(target.startswith("opalctl") for target in modules.targets(name, node))
             and not any(modules.heavy(m) - modules.heavy(name) for m in modules.runs(name, node))]
    unexplained = sorted(set(light))
    assert unexplained == [], ("imports inside functions that bring no heavy package the module does not import "
                               "already (move them to the top of the module):\n" + "\n".join(unexplained))


def test_importing_the_command_line_imports_no_heavy_package():
    result = subprocess.run([sys.executable, "-c", "import sys, opalctl.cli; print(' '.join(sys.modules))"],
                            capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    imported = {name.split(".")[0] for name in result.stdout.split()}
    assert sorted(imported & HEAVY) == []
    ours = sorted(name for name in result.stdout.split() if name.startswith("opalctl"))
    assert len(ours) <= 15, f"import opalctl.cli imports {len(ours)} modules of opalctl (commands import theirs): {ours}"


def test_the_grid_and_compare_import_no_torch():
    """A grid process (and its closing compare) and ``opalctl compare`` train nothing: importing torch would cost
    each of them more than a CPU-second (the grid's tests start many of them). They read the protocol (pydantic)."""
    modules = "opalctl.grid.runner, opalctl.grid.summary, opalctl.compare.aggregate"
    result = subprocess.run([sys.executable, "-c", f"import sys, {modules}; print(' '.join(sys.modules))"],
                            capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert "torch" not in {name.split(".")[0] for name in result.stdout.split()}
