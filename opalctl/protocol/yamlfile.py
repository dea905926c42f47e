"""Reading a protocol's YAML so that every later error can name the line it came from.

PyYAML's ``safe_load`` forgets where things were and silently keeps the last of two equal keys. Here the
document is composed into nodes first, which keeps each key's line and lets a repeated key be refused, and only
then constructed into plain Python values with the safe constructor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from opalctl.errors import BadInput


def _walk(node: yaml.Node, path: tuple, lines: dict[tuple, int], where: str) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else repr(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                dotted = ".".join(str(p) for p in path + (key,))
                raise BadInput(f"{where} line {line}: key {dotted} appears twice (first on line {seen[key]}); "
                               f"keep one")
            seen[key] = line
            lines[path + (key,)] = line
            _walk(value_node, path + (key,), lines, where)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[path + (index,)] = item.start_mark.line + 1
            _walk(item, path + (index,), lines, where)


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[tuple, int]]:
    """Return the document and a map from key path (strings for keys, ints for list items) to line number."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(f"protocol {where} does not exist; check the path (or write one with `opalctl init`)") from None
    except IsADirectoryError:
        raise BadInput(f"protocol {where} is a folder; give the path of a .yaml file") from None
    except UnicodeDecodeError:
        raise BadInput(f"protocol {where} is not UTF-8 text; save it as UTF-8") from None
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise BadInput(f"protocol {where} is empty; start from `opalctl init digits`")
        lines: dict[tuple, int] = {}
        _walk(node, (), lines, where)
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = (error.problem or error.context or "it is not valid YAML").strip()
        raise BadInput(f"{where}{line}: the YAML cannot be parsed ({problem}); fix the syntax there") from None
    except yaml.YAMLError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else "it is not valid YAML"
        raise BadInput(f"{where}: the YAML cannot be parsed ({first}); fix the syntax") from None
    except RecursionError:
        raise BadInput(f"{where}: the YAML nests too deeply; a protocol is a few levels deep") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise BadInput(f"protocol {where} must be a mapping of keys (name, task, data, ...), not a "
                       f"{type(data).__name__}")
    return data, lines
