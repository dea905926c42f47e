"""Tasks: the interface (``base``), the built-in tasks, and how a protocol's ``task.entry`` is found."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
from pathlib import Path

from opalctl.errors import BadInput
from opalctl.tasks.calls import CalledTask, task_failed

BUILTIN = {
    "digits": "opalctl.tasks.digits:Digits",
    "pylm": "opalctl.tasks.pylm:PyLM",
    "modular": "opalctl.tasks.modular:Modular",
    "illcond": "opalctl.tasks.illcond:IllConditioned",
    "shapes": "opalctl.tasks.shapes:Shapes",
}


class TaskLoadError(BadInput):
    pass


def load_task_class(entry: str):
    from opalctl.tasks.base import Task

    module_name, _, class_name = entry.partition(":")
    if not module_name or not class_name:
        raise TaskLoadError(f"write the task entry as module:Class, not {entry!r}")
    try:
        module = quiet_import(module_name)
    except ModuleNotFoundError as error:
        raise TaskLoadError(f"module {module_name!r} cannot be imported ({error}); install it or fix the entry") from None
    except (Exception, SystemExit) as error:  # the task's own module failed (or exited) while importing
        text = " ".join(str(error).split())[:160]
        raise TaskLoadError(f"module {module_name!r} failed to import: {type(error).__name__}: {text}; fix the "
                            f"module or the entry") from None
    cls = getattr(module, class_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, Task)):
        raise TaskLoadError(f"{module_name} has no task class {class_name!r} (a subclass of opalctl.tasks.base.Task)")
    return cls


def quiet_import(module_name: str):
    """Import ``module_name`` with what it prints on import kept from opalctl's own output: stdout carries a
    command's report (one JSON document under ``--json``) and a refusal is one line on stderr."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return importlib.import_module(module_name)


def task_source_file(entry: str) -> Path:
    """The file that defines the task class, for the lock's records."""
    cls = load_task_class(entry)
    return Path(inspect.getfile(cls)).resolve()


def make_task(entry: str, config: dict):
    """The task of ``entry`` with ``config``, as opalctl calls it: every call into it checked, its failure one
    sentence naming the task and the method (opalctl/tasks/calls.py)."""
    cls = load_task_class(entry)
    try:
        return CalledTask(cls(config), entry)
    except BadInput:
        raise
    except Exception as error:
        raise task_failed(entry, "__init__", error) from error
