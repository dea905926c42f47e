"""``opalctl init TASK``: a ready protocol, its data files and one parent per seed, for a built-in task.

Everything is first written into a staging folder, then compared with what is already there: a file with the
same bytes is left alone, a file with other bytes stops the whole init before anything is moved (nothing the
user already has is ever overwritten), and only then are the new files moved into place. Running init twice
therefore writes the same bytes and reports every file unchanged the second time.
"""

from __future__ import annotations

import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from opalctl.errors import BadInput
from opalctl.files import storage
from opalctl.tasks import BUILTIN, make_task

DEFAULT_SEEDS = (1, 2, 3)


def protocol_text(task_name: str, seeds: list[int]) -> str:
    template = resources.files("opalctl.tasks").joinpath("templates", f"{task_name}.yaml").read_text("utf-8")
    return template.replace("{seeds}", "[" + ", ".join(str(s) for s in seeds) + "]")


def init(task_name: str, folder: str | Path = ".", seeds: list[int] | None = None,
         say=lambda text: None, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config``: task settings over the template's (``opalctl suite`` passes a task's overrides, so its data and
    parents are made with them); the protocol written beside them is the template's, as always."""
    if task_name not in BUILTIN:
        raise BadInput(f"there is no built-in task {task_name!r}; choose one of {', '.join(sorted(BUILTIN))}")
    seeds = list(seeds or DEFAULT_SEEDS)
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise BadInput("--seeds must be distinct non-negative integers, e.g. --seeds 1,2,3")
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"--dir {folder} is a file; give a folder")
    # a write the storage refuses names its file, and the files already in place stay as they were (every new
    # file is staged whole first, then moved in by a rename)
    with storage(folder, then=f"run `opalctl init {task_name}` again (or give --dir a folder that can be written)"):
        folder.mkdir(parents=True, exist_ok=True)
        text = protocol_text(task_name, seeds)
        config = {**yaml.safe_load(text)["task"].get("config", {}), **(config or {})}
        task = make_task(BUILTIN[task_name], config)
        say(f"preparing {task_name} in {folder} (data files and one parent per seed)...")
        staging = Path(tempfile.mkdtemp(prefix=".opalctl-init-", dir=folder))
        try:
            task.prepare(staging, seeds)
            (staging / f"{task_name}.yaml").write_text(text, encoding="utf-8")
            staged = sorted(p for p in staging.rglob("*") if p.is_file() and not p.name.startswith("."))
            files, conflicts = [], []
            for path in staged:
                relative = path.relative_to(staging)
                target = folder / relative
                if target.exists():
                    same = target.is_file() and target.read_bytes() == path.read_bytes()
                    (files if same else conflicts).append((relative, "unchanged"))
                else:
                    files.append((relative, "written"))
            if conflicts:
                shown = ", ".join(str(folder / r) for r, _ in conflicts[:3])
                raise BadInput(f"{shown} already exist{'s' if len(conflicts) == 1 else ''} with other contents; "
                               f"init never overwrites, so choose another --dir or move {'it' if len(conflicts) == 1 else 'them'} away")
            for relative, status in files:
                if status == "written":
                    target = folder / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(staging / relative), str(target))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {
        "task": task_name,
        "protocol": str(folder / f"{task_name}.yaml"),
        "seeds": seeds,
        "files": [{"path": str(folder / r), "status": s} for r, s in files],
        "written": sum(1 for _, s in files if s == "written"),
    }
