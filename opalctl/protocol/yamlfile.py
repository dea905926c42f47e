"""Reading a protocol's YAML so that every later error can name the line it came from.

PyYAML's ``safe_load`` forgets where things were and silently keeps the last of two equal keys. Here the
document is composed into nodes first, which keeps each key's line and lets a repeated key be refused, and only
then constructed into plain Python values with the safe constructor.

Three things a plain ``safe_load`` gets wrong for a protocol are settled before any value is built:

- size. A file over ``MAX_BYTES`` is refused unread, and the composed document is measured as it would be once
  every alias is expanded (``MAX_NODES`` nodes, ``MAX_DEPTH`` levels): a few hundred bytes of nested aliases
  expand to billions of nodes, and walking them would take minutes and gigabytes. The measure visits each node
  once (aliases share their node), so it costs no more than the text itself; the nesting is counted from the
  parser's events before the (recursive) composer runs;
- numbers. YAML 1.1 reads ``1e-3``, ``4e1`` and ``1E5`` as strings (its floats need a dot and a signed
  exponent); the protocol's reader also takes them as numbers, as YAML 1.2 and every person does;
- huge integers. Python refuses to convert an integer of more than a few thousand digits; that is refused here
  as a number too long rather than an internal error.
"""

from __future__ import annotations

import re
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from opalctl.errors import BadInput

MAX_BYTES = 1 << 20  # a protocol is a few kilobytes; a megabyte leaves room for long comments and many arms
MAX_NODES = 100_000  # after expanding aliases: the shipped protocols have about 150
MAX_DEPTH = 64  # a protocol is about six levels deep

# a number with an exponent but no dot (1e-3, 4e1, 1E5, -2.5E+3 is already a float in YAML 1.1)
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class ProtocolLoader(yaml.SafeLoader):
    """The safe loader, with exponent numbers read as floats (a subclass: PyYAML's own loader is left as it is)."""


ProtocolLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+0123456789."))


class TooLarge(Exception):
    """The composed document exceeds a limit; ``args[0]`` is what to tell the person."""


def measure(root: yaml.Node) -> None:
    """Raise ``TooLarge`` when ``root`` expanded (every alias copied in place) has over ``MAX_NODES`` nodes or
    ``MAX_DEPTH`` levels, or refers to itself. Iterative, and each distinct node is sized once."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            open_nodes.discard(key)
            children = _children(node)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            depths[key] = 1 + max((depths[id(child)] for child in children), default=0)
            if sizes[key] > MAX_NODES:
                raise TooLarge(f"the document expands to more than {MAX_NODES} values (through its aliases); a "
                               f"protocol needs a few hundred, so remove the aliases that repeat large parts")
            if depths[key] > MAX_DEPTH:
                raise TooLarge(f"the document nests more than {MAX_DEPTH} levels deep; a protocol is a few levels "
                               f"deep")
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise TooLarge("an alias refers to a value that contains it; a protocol cannot be recursive")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)


def shallow(text: str) -> None:
    """Raise ``TooLarge`` when the text nests over ``MAX_DEPTH`` levels. PyYAML's parser is a loop but its
    composer recurses once per level, so three thousand ``[`` took seconds to end in a RecursionError; the
    events are counted first, which costs a fraction of composing."""
    depth = 0
    for event in yaml.parse(text, Loader=ProtocolLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise TooLarge(f"the document nests more than {MAX_DEPTH} levels deep; a protocol is a few levels "
                               f"deep")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _walk(node: yaml.Node, path: tuple, lines: dict[tuple, int], where: str) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else repr(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                dotted = ".".join(str(p) for p in path + (key,))
                raise BadInput(f"{where} line {line}: key {_shown(dotted)} appears twice (first on line {seen[key]}); "
                               f"keep one")
            seen[key] = line
            lines[path + (key,)] = line
            _walk(value_node, path + (key,), lines, where)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[path + (index,)] = item.start_mark.line + 1
            _walk(item, path + (index,), lines, where)


def _shown(text: str) -> str:
    """A key as a refusal shows it: on one line, and not the whole of a very long one."""
    text = text if text.isprintable() else repr(text)[1:-1]
    return text if len(text) <= 80 else text[:77] + "..."


def _read(path: Path) -> str:
    """The protocol's text, read only when it is a regular file within ``MAX_BYTES`` (a device or a pipe given by
    mistake would never end)."""
    where = str(path)
    try:
        mode = path.stat().st_mode
        if stat.S_ISDIR(mode):
            raise BadInput(f"protocol {where} is a folder; give the path of a .yaml file")
        if not stat.S_ISREG(mode):
            raise BadInput(f"protocol {where} is not a regular file; give the path of a .yaml file")
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise BadInput(f"protocol {where} is over {MAX_BYTES >> 20} MiB; a protocol is a few kilobytes, so give "
                           f"the right file")
        return data.decode("utf-8")
    except FileNotFoundError:
        raise BadInput(f"protocol {where} does not exist; check the path (or write one with `opalctl init`)") from None
    except UnicodeDecodeError:
        raise BadInput(f"protocol {where} is not UTF-8 text; save it as UTF-8") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        reason = getattr(error, "strerror", None) or " ".join(str(error).split())[:80]
        raise BadInput(f"protocol {where!r} cannot be read ({reason}); check the path and its permissions") from None


def _unreadable(error: ValueError) -> str:
    if "integer string conversion" in str(error):
        return (f"an integer has more than {sys.get_int_max_str_digits()} digits; write a shorter number (or "
                f"quote it, if it is text)")
    first = " ".join(str(error).split())[:120] or type(error).__name__
    return f"a value cannot be read ({first}); fix it or quote it"


def load_yaml_with_lines(path: Path) -> tuple[Any, dict[tuple, int]]:
    """Return the document and a map from key path (strings for keys, ints for list items) to line number."""
    where = str(path)
    text = _read(path)
    loader = None
    try:
        shallow(text)
        loader = ProtocolLoader(text)  # its reader refuses control characters here already
        node = loader.get_single_node()
        if node is None:
            raise BadInput(f"protocol {where} is empty; start from `opalctl init digits`")
        measure(node)
        lines: dict[tuple, int] = {}
        _walk(node, (), lines, where)
        data = loader.construct_document(node)
    except TooLarge as error:
        raise BadInput(f"{where}: {error.args[0]}") from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f" line {mark.line + 1}" if mark is not None else ""
        problem = " ".join((error.problem or error.context or "it is not valid YAML").split())
        raise BadInput(f"{where}{line}: the YAML cannot be parsed ({problem}); fix the syntax there") from None
    except yaml.YAMLError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else "it is not valid YAML"
        raise BadInput(f"{where}: the YAML cannot be parsed ({first}); fix the syntax") from None
    except ValueError as error:  # the constructor: an integer too long for Python to convert, a bad date
        raise BadInput(f"{where}: {_unreadable(error)}") from None
    except RecursionError:
        raise BadInput(f"{where}: the YAML nests too deeply; a protocol is a few levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(data, dict):
        raise BadInput(f"protocol {where} must be a mapping of keys (name, task, data, ...), not a "
                       f"{type(data).__name__}")
    return data, lines
