"""``opalctl suite freeze SUITE.yaml``: every task's protocol written and frozen (``protocol.freeze``), then the
suite lock naming them.

Nothing already written is lost: every task's protocol is made first, and if one differs from the file already
there the whole freeze is refused before anything is written (``--force`` replaces them; each replaced task lock
and suite lock is kept beside the new one as ``NAME.lock.SHA12.json``, as ``freeze`` keeps one). A built-in task's
data and parents are made by ``opalctl init``, which never overwrites a file with other bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from opalctl.errors import BadInput
from opalctl.files import atomic_write_text, canonical_json, file_record, read_plain, sha256_bytes, storage
from opalctl.protocol.freeze import freeze, write_lock
from opalctl.protocol.schema import parse, validate
from opalctl.suite.lock import FORMAT, suite_lock_path
from opalctl.suite.protocols import base_protocol, protocol_path, protocol_text, task_protocol
from opalctl.suite.spec import load_suite


def suite_folder(suite_path: Path, name: str, folder: str | Path | None) -> Path:
    """Where the suite's tasks are written: ``--dir``, or a folder named after the suite beside its file."""
    return Path(folder) if folder is not None else suite_path.parent / name


def freeze_suite(suite_path: str | Path, *, folder: str | Path | None = None, force: bool = False,
                 say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    suite_path = Path(suite_path)
    suite, document = load_suite(suite_path)
    folder = suite_folder(suite_path, suite.name, folder)
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"--dir {folder} is a file; give a folder for the suite's tasks")
    texts: dict[str, tuple[Path, str]] = {}
    with storage(folder, then="freeze the suite again (or give --dir a folder that can be written)"):
        for task in suite.tasks:
            target_folder = protocol_path(folder, suite, task).parent
            base, base_folder = base_protocol(suite, task, suite_path, folder, say)
            protocol = task_protocol(suite, document, task, base, base_folder, target_folder, suite_path)
            texts[task] = (protocol_path(folder, suite, task), protocol_text(suite, suite_path, task, protocol))
            _check(texts[task][1], f"{suite_path} (task {task}, as {texts[task][0].name})", target_folder)
        differing = [path for path, text in texts.values() if path.exists() and _differs(path, text)]
        if differing and not force:
            raise BadInput(f"{differing[0]} was written by an earlier freeze of the suite and differs from what it "
                           f"would write now; pass --force to replace it (its lock is kept beside it)")
        tasks: dict[str, dict[str, Any]] = {}
        for task, (path, text) in texts.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.exists() or _differs(path, text):
                atomic_write_text(path, text)
            say(f"freeze {path}")
            frozen = freeze(path, force=force)
            lock_path = Path(frozen["lock"])
            tasks[task] = {"lock": str(_relative(lock_path, folder)), "sha256": frozen["sha256"],
                           "protocol": str(_relative(path, folder)), "seeds": frozen["seeds"],
                           "outcome": frozen["outcome"], "warnings": frozen["warnings"]}
        lock = {"format": FORMAT, "status": "frozen", "name": suite.name, "baseline": suite.baseline,
                "suite_file": file_record(suite_path, folder), "suite": document,
                "arms": list(suite.arms),
                "tasks": {task: {key: entry[key] for key in ("lock", "sha256", "protocol", "seeds")}
                          for task, entry in tasks.items()}}
        text = canonical_json(lock)
        path = suite_lock_path(folder, suite.name)
        outcome = write_lock(path, text, force)
    return {"suite": str(suite_path), "suite_lock": str(path), "sha256": sha256_bytes(text.encode("utf-8")),
            "outcome": outcome, "name": suite.name, "folder": str(folder), "baseline": suite.baseline,
            "arms": list(suite.arms), "tasks": tasks}


def _check(text: str, where: str, folder: Path) -> None:
    """A task's protocol checked whole, as ``freeze`` will check its file, before any protocol is written."""
    data = yaml.safe_load(text)
    validate(parse(data, {}, where), {}, where, folder)


def _differs(path: Path, text: str) -> bool:
    try:
        return read_plain(path, 1 << 20) != text.encode("utf-8")
    except OSError:
        return True


def _relative(path: Path, folder: Path) -> Path:
    return Path(os.path.relpath(path.resolve(), folder.resolve()))
