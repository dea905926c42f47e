"""The run's workspace as an agent's file tools see it: every path confined to it, the optimizer's folder read-only.

An absolute path, a ``..`` part, or a symlink that leads out is refused with ``Refused``, whose message goes back
to the agent as the tool's result (the agent reads it and goes on). ``.opal`` belongs to the optimizer: it can be
read, never written.
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

MAX_READ_CHARS = 100_000
MAX_WRITE_CHARS = 200_000
META_FOLDER = ".opal"


class Refused(Exception):
    """A tool call the workspace refuses; the message goes back to the agent as the tool's result."""


class Workspace:
    """The run's workspace, with every path confined to it."""

    def __init__(self, root: Path):
        self.root = Path(os.path.realpath(root))

    def path(self, given: Any, *, write: bool = False) -> Path:
        if not isinstance(given, str) or not given.strip():
            raise Refused("give a path relative to the workspace, e.g. updater.py")
        if "\x00" in given:
            raise Refused("a path may not contain a NUL character")
        text = given.strip()
        pure = PurePosixPath(text.replace("\\", "/"))
        if pure.is_absolute() or text.startswith("~") or re.match(r"^[A-Za-z]:", text):
            raise Refused(f"{given!r} is an absolute path; paths are relative to the workspace (e.g. updater.py)")
        if ".." in pure.parts:
            raise Refused(f"{given!r} goes up with '..'; only files inside the workspace can be used")
        target = Path(os.path.realpath(self.root / pure))
        if target != self.root and self.root not in target.parents:
            raise Refused(f"{given!r} leads outside the workspace (through a symbolic link); only files inside the "
                          f"workspace can be used")
        relative = target.relative_to(self.root)
        if write and (relative.parts[:1] == (META_FOLDER,) or target == self.root):
            raise Refused(f"{given!r} cannot be written: {META_FOLDER}/ belongs to the optimizer; edit updater.py "
                          f"or analysis.py")
        return target

    def list_files(self, folder: Any = None) -> str:
        base = self.path(folder) if folder not in (None, "", ".") else self.root
        if not base.is_dir():
            raise Refused(f"{folder!r} is not a folder of the workspace")
        lines = []
        for current, folders, files in os.walk(base):
            folders[:] = sorted(f for f in folders if f not in (META_FOLDER, "__pycache__"))
            for name in sorted(files):
                path = Path(current) / name
                relative = path.relative_to(self.root).as_posix()
                if path.is_symlink():
                    lines.append(f"{relative} (a link)")
                else:
                    lines.append(f"{relative} ({path.stat().st_size} bytes)")
                if len(lines) >= 200:
                    return "\n".join(lines + ["(more files not listed)"])
        return "\n".join(lines) or "(no files)"

    def read(self, given: Any) -> str:
        path = self.path(given)
        if not path.is_file():
            raise Refused(f"{given!r} is not a file of the workspace (list_files shows them)")
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > MAX_READ_CHARS:
            return text[:MAX_READ_CHARS] + f"\n... (cut at {MAX_READ_CHARS} characters of {len(text)})"
        return text

    def write(self, given: Any, content: Any) -> str:
        if not isinstance(content, str):
            raise Refused("content must be the file's text (a string)")
        if len(content) > MAX_WRITE_CHARS:
            raise Refused(f"the content has {len(content)} characters; the limit is {MAX_WRITE_CHARS}")
        path = self.path(given, write=True)
        if path.is_dir():
            raise Refused(f"{given!r} is a folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        return f"wrote {path.relative_to(self.root).as_posix()} ({len(content.splitlines())} lines)"

    def replace(self, given: Any, old: Any, new: Any) -> str:
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise Refused("old must be a non-empty string and new a string")
        path = self.path(given, write=True)
        if not path.is_file():
            raise Refused(f"{given!r} is not a file of the workspace (list_files shows them)")
        text = path.read_text(encoding="utf-8")
        count = text.count(old)
        if count != 1:
            raise Refused(f"the old text occurs {count} times in {given}; it must occur exactly once (include more "
                          f"of the surrounding lines)" if count else f"the old text does not occur in {given}; read "
                          f"the file and copy the text exactly")
        path.write_text(text.replace(old, new, 1), encoding="utf-8")
        return f"replaced 1 occurrence in {path.relative_to(self.root).as_posix()}"
