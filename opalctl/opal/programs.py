"""Agent programs: the static check that refuses dangerous code, and loading a program as a private module.

An agent writes two ordinary Python files, ``updater.py`` and ``analysis.py``. Before either runs, both pass
the static check of ``allowlist.py`` (what a program may import and reach, refused with a sentence the agent
can act on). The check is one layer: the guards of ``guard.py`` contain what a program's calls do (failures,
time limits, global torch state), and the operating system's confinement of the training process the rest.

A program that passes is compiled and executed into a fresh module object that is never put in
``sys.modules`` and never found through ``sys.path``: two versions of ``updater.py`` never share state, and
nothing else in the process can import them.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from opalctl.opal.allowlist import check_source

__all__ = ["PROGRAM_FILES", "UPDATER", "ANALYSIS", "default_sources", "Program", "ProgramRejected", "UnreadableProgram", "check_program", "check_source",
           "load_program", "read_program_file"]

# the two files an agent writes and the optimizer loads, in every place that names them: the workspace, the host's
# answer, a version's folder in the records, the training folder's shape, replay
UPDATER, ANALYSIS = "updater.py", "analysis.py"
PROGRAM_FILES = (UPDATER, ANALYSIS)


def default_sources() -> dict[str, str]:
    """The released starting programs (``opal/defaults``), by file name: version 0 of every agent arm."""
    folder = resources.files("opalctl.opal").joinpath("defaults")
    return {name: folder.joinpath(name).read_text("utf-8") for name in PROGRAM_FILES}


class ProgramRejected(Exception):
    """A program that failed the static check or could not be loaded; the message is for the agent."""


@dataclass
class Program:
    """One version of one program file, loaded."""

    name: str  # "updater" or "analysis"
    source: str
    module: types.ModuleType
    sha256: str


class UnreadableProgram(str):
    """The text of a program file that cannot be a program (a folder, bytes that are not UTF-8): what could be read,
    with ``reason``, the sentence ``load_program`` refuses it with."""

    reason: str

    def __new__(cls, text: str, reason: str) -> UnreadableProgram:
        value = super().__new__(cls, text)
        value.reason = reason
        return value


def read_program_file(path: Path) -> str:
    """A program file of the workspace as the loader takes it: its text; an empty text when it is missing; an
    ``UnreadableProgram`` when it is a folder (or anything but a file) or not valid UTF-8."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return ""
    if not path.is_file():
        return UnreadableProgram("", f"{path.name} is not a file (a folder, say); write the program as a plain "
                                     f"file named {path.name}")
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        return UnreadableProgram(data.decode("utf-8", "replace"),
                                 f"{path.name} is not valid UTF-8 text (byte {data[error.start]:#04x} at offset "
                                 f"{error.start}); save it as UTF-8")


def check_program(name: str, source: str, *, label: str = "") -> str:
    """The file name ``source`` is refused under when it does not pass the static check (ProgramRejected, with
    every reason); returns that file name when it passes. Nothing of the program runs."""
    filename = f"{label or name}.py"
    if isinstance(source, UnreadableProgram):
        raise ProgramRejected(f"{filename}: {source.reason}")
    if not isinstance(source, str):
        raise ProgramRejected(f"{filename}: the program is not text; write it as a UTF-8 file")
    try:
        source.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ProgramRejected(f"{filename} is not valid UTF-8 text (offset {error.start}); save it as UTF-8") from None
    problems = check_source(source, filename)
    if problems:
        raise ProgramRejected("; ".join(problems))
    return filename


Runner = Callable[..., "tuple[Any, BaseException | None]"]


def _run_directly(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    from opalctl.opal.guard import contained

    return contained(fn, *args)


def load_program(name: str, source: str, *, label: str = "", run: Runner | None = None) -> Program:
    """Check and load ``source`` into a fresh private module; raises ProgramRejected with the reasons. The check
    comes first: a refused program never runs. Its top-level code runs through ``run`` (``run(fn, *args) ->
    (value, error)``: the caller's guard, with its time limit; by default ``guard.contained``), and any exception
    of it (SystemExit and KeyboardInterrupt included) is a rejection."""
    filename = check_program(name, source, label=label)
    module = types.ModuleType(f"opalctl_program_{name}")
    module.__file__ = filename
    code = compile(source, filename, "exec", dont_inherit=True)
    _, error = (run or _run_directly)(exec, code, module.__dict__)
    if error is not None:  # the program's own top-level code failed
        from opalctl.opal.guard import failure_text  # its text, read without running the exception's code

        raise ProgramRejected(f"{filename} failed while loading: {failure_text(error)}") from None
    return Program(name=name, source=source, module=module, sha256=hashlib.sha256(source.encode()).hexdigest())
