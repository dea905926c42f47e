"""The shape of the code: the largest classes (lines, attributes set in ``__init__``) and the widest signatures
(parameters) of a package, read from its source with ``ast`` (nothing is imported or run).

    python bench/code_shape.py [FOLDER] [--top N] [--json]

FOLDER defaults to ``opalctl/opal``. Issue 29 aims at no class over about 300 lines with 20 attributes; this is
how that is measured before and after a change.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path


def _init_attributes(node: ast.ClassDef) -> set[str]:
    """The names ``self.NAME = ...`` (or ``setattr(self, ...)``, counted once per call) binds in ``__init__``."""
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for sub in ast.walk(item):
                targets = (sub.targets if isinstance(sub, ast.Assign)
                           else [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else [])
                for target in targets:
                    for leaf in ast.walk(target):
                        if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                                and leaf.value.id == "self"):
                            names.add(leaf.attr)
                if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "setattr"
                        and sub.args and isinstance(sub.args[0], ast.Name) and sub.args[0].id == "self"):
                    names.add(f"setattr@{sub.lineno}")
    return names


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Named parameters, ``self``/``cls`` left out (``*args``/``**keywords`` count one each)."""
    args = node.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if named and named[0] in ("self", "cls"):
        named = named[1:]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def measure(folder: Path) -> dict[str, list[dict]]:
    classes, functions = [], []
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text("utf-8"))
        where = str(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.append({"name": f"{where}:{node.name}", "lines": node.end_lineno - node.lineno + 1,
                                "attributes": len(_init_attributes(node))})
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append({"name": f"{where}:{node.name}", "line": node.lineno,
                                  "parameters": _parameters(node)})
    classes.sort(key=lambda c: (-c["lines"], c["name"]))
    functions.sort(key=lambda f: (-f["parameters"], f["name"]))
    return {"classes": classes, "signatures": functions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="opalctl/opal")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    found = measure(Path(options.folder))
    top = {"classes": found["classes"][:options.top], "signatures": found["signatures"][:options.top]}
    if options.json:
        print(json.dumps(top, indent=1))
        return
    print("largest classes (lines, attributes set in __init__):")
    for c in top["classes"]:
        print(f"  {c['lines']:5d} lines {c['attributes']:3d} attributes  {c['name']}")
    by_attributes = sorted(found["classes"], key=lambda c: -c["attributes"])[:options.top]
    print("most attributes set in __init__:")
    for c in by_attributes:
        print(f"  {c['attributes']:3d} attributes {c['lines']:5d} lines  {c['name']}")
    print("widest signatures (parameters, self left out):")
    for f in top["signatures"]:
        print(f"  {f['parameters']:3d}  {f['name']}:{f['line']}")


if __name__ == "__main__":
    main()
