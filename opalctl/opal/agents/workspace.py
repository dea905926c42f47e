"""The workspace: a folder the backend cannot link out of, what it may write in one decision, and the agent host's
hold on it.

Three sides use it. The agent's file tools (``Workspace``): every path is confined to the folder, an absolute path
or a ``..`` part is refused, a symbolic link anywhere on the way (the file itself, or a folder above it) is
refused for reading and replaced, never followed, for writing, and ``.opal`` belongs to the optimizer (it can
be read, never written). A decision may write at most ``MAX_FILES_PER_DECISION`` files and
``MAX_BYTES_PER_DECISION`` bytes; past that each write is refused with a sentence the agent can act on. Every
refusal is a ``Refused`` whose message goes back to the agent as the tool's result.

The agent host (``FixedWorkspace``): its workspace is the folder it was given when it started, before any agent
code existed (a formal run's ``agent/workspace``, outside what the confined training process may write), never one
a request names. Every use checks it by real path and identity (``checked``): still the real folder it was at
start, not replaced by a link or another folder; only then does the host write the running programs and the facts
into it (``put``), hand it to a worker, sweep it and read the programs back (``programs``).

The writers and readers both use (``write_file_here``, ``read_program``, ``sweep``): a file is written by renaming
a fresh file over the name (a link left there is replaced, not followed), a program is read back only from a
regular UTF-8 file opened without following links and within ``MAX_PROGRAM_BYTES``, and after a decision the sweep
removes links and special files and files past the limits, and puts every file through the redaction. A backend
that answers in the training process (``keep``, a callable given to ``wrap()``) keeps a workspace of its own there,
used the same way.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from opalctl.opal.programs import PROGRAM_FILES
from opalctl.opal.records import FACTS, MESSAGE

MAX_READ_CHARS = 100_000
MAX_WRITE_CHARS = 200_000
MAX_FILES_PER_DECISION = 64
MAX_BYTES_PER_DECISION = 4_000_000
META_FOLDER = ".opal"
# a program is read whole into the message and the records; anything larger is not a program
MAX_PROGRAM_BYTES = 1_000_000


class Refused(Exception):
    """A tool call the workspace refuses; the message goes back to the agent as the tool's result."""


def _is_link(path: Path) -> bool:
    return os.path.islink(path)


def _relative_parts(given: Any) -> tuple[str, ...]:
    """The parts of a path an agent gave, checked as text: relative, no ``..``, no NUL."""
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
    return tuple(part for part in pure.parts if part not in ("", "."))


class Workspace:
    """The run's workspace as one decision's file tools see it (the write counters are this decision's)."""

    def __init__(self, root: Path, redaction: Callable[[str], str] | None = None,
                 max_files: int = MAX_FILES_PER_DECISION, max_bytes: int = MAX_BYTES_PER_DECISION):
        self.root = Path(os.path.realpath(root))
        self.redaction = redaction or (lambda text: text)
        self.max_files, self.max_bytes = max_files, max_bytes
        self.written: set[str] = set()
        self.bytes_written = 0

    def path(self, given: Any, *, write: bool = False) -> Path:
        """The path ``given`` names in the workspace; every folder on the way must be a real folder (a link is
        refused), and the name itself must not be a link unless it is about to be replaced (``write``)."""
        parts = _relative_parts(given)
        target = self.root.joinpath(*parts)
        for depth in range(1, len(parts)):
            if _is_link(self.root.joinpath(*parts[:depth])):
                raise Refused(f"{given!r} leads outside the workspace (through a symbolic link); links are not "
                              f"followed here: use paths of real folders inside the workspace")
        if not write and parts and _is_link(target):
            raise Refused(f"{given!r} leads outside the workspace (through a symbolic link); links are not "
                          f"followed here: write the file itself with write_file, which replaces the link")
        if write and (parts[:1] == (META_FOLDER,) or not parts):
            raise Refused(f"{given!r} cannot be written: {META_FOLDER}/ belongs to the optimizer; edit updater.py "
                          f"or analysis.py")
        return target

    def list_files(self, folder: Any = None) -> str:
        base = self.path(folder) if folder not in (None, "", ".") else self.root
        if _is_link(base) or not base.is_dir():
            raise Refused(f"{folder!r} is not a folder of the workspace")
        lines = []
        for current, folders, files in os.walk(base):  # links to folders are listed, never entered
            links = sorted(f for f in folders if _is_link(Path(current) / f))
            folders[:] = sorted(f for f in folders if f not in (META_FOLDER, "__pycache__") and f not in links)
            for name in sorted(files + links):
                path = Path(current) / name
                relative = path.relative_to(self.root).as_posix()
                if _is_link(path):
                    lines.append(f"{relative} (a link)")
                else:
                    lines.append(f"{relative} ({path.lstat().st_size} bytes)")
                if len(lines) >= 200:
                    return "\n".join(lines + ["(more files not listed)"])
        return "\n".join(lines) or "(no files)"

    def read(self, given: Any) -> str:
        data = _read_regular(self.path(given), MAX_READ_CHARS * 4 + 4)
        if data is None:
            raise Refused(f"{given!r} is not a file of the workspace (list_files shows them)")
        text = data.decode("utf-8", errors="replace")
        if len(text) > MAX_READ_CHARS:
            return text[:MAX_READ_CHARS] + f"\n... (cut at {MAX_READ_CHARS} characters)"
        return text

    def write(self, given: Any, content: Any) -> str:
        if not isinstance(content, str):
            raise Refused("content must be the file's text (a string)")
        if len(content) > MAX_WRITE_CHARS:
            raise Refused(f"the content has {len(content)} characters; the limit is {MAX_WRITE_CHARS}")
        path = self.path(given, write=True)
        if path.is_dir() and not _is_link(path):
            raise Refused(f"{given!r} is a folder")
        relative = path.relative_to(self.root).as_posix()
        data = self.redaction(content).encode("utf-8")
        self._count(relative, len(data))
        _make_folders(self.root, path.parent)
        write_file_here(path, data)
        return f"wrote {relative} ({len(content.splitlines())} lines)"

    def _count(self, relative: str, size: int) -> None:
        """Count one write against this decision's limits, or refuse it."""
        if relative not in self.written and len(self.written) >= self.max_files:
            raise Refused(f"this decision has already written {len(self.written)} files, the most one decision may "
                          f"write; write to files you already wrote (only updater.py and analysis.py are loaded)")
        if self.bytes_written + size > self.max_bytes:
            raise Refused(f"writing {size} more bytes would pass the {self.max_bytes} bytes one decision may write "
                          f"({self.bytes_written} written so far); write less (only updater.py and analysis.py are "
                          f"loaded)")
        self.written.add(relative)
        self.bytes_written += size

    def replace(self, given: Any, old: Any, new: Any) -> str:
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise Refused("old must be a non-empty string and new a string")
        self.path(given, write=True)
        text = self.read_whole(given)
        count = text.count(old)
        if count != 1:
            raise Refused(f"the old text occurs {count} times in {given}; it must occur exactly once (include more "
                          f"of the surrounding lines)" if count else f"the old text does not occur in {given}; read "
                          f"the file and copy the text exactly")
        self.write(given, text.replace(old, new, 1))
        return f"replaced 1 occurrence in {self.path(given).relative_to(self.root).as_posix()}"

    def read_whole(self, given: Any) -> str:
        data = _read_regular(self.path(given), MAX_WRITE_CHARS * 4 + 4)
        if data is None:
            raise Refused(f"{given!r} is not a file of the workspace (list_files shows them)")
        return data.decode("utf-8", errors="replace")


def _make_folders(root: Path, folder: Path) -> None:
    """Create ``folder`` under ``root``, refusing a link or a file on the way."""
    current = root
    for part in folder.relative_to(root).parts:
        current = current / part
        if _is_link(current) or (current.exists() and not current.is_dir()):
            raise Refused(f"{current.relative_to(root).as_posix()!r} is not a folder of the workspace")
        if not current.exists():
            current.mkdir()


def _read_regular(path: Path, limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``path`` when it is a regular file (opened without following a link and
    without blocking on a fifo); None when it is missing, a link, a folder or another kind of file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(limit)
    finally:
        os.close(fd)


def write_file_here(path: Path, data: bytes) -> None:
    """Put ``data`` at ``path`` by renaming a fresh file over it: a link there is replaced, never followed; a
    folder or special file there is removed first."""
    path = Path(path)
    if not _is_link(path) and path.is_dir():
        shutil.rmtree(path)
    elif _is_link(path) or (path.exists() and not path.is_file()):
        path.unlink()
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def real_folder(path: Path) -> Path:
    """``path`` as a real folder: a link or a file left in its place is removed and the folder made."""
    path = Path(path)
    if _is_link(path) or (path.exists() and not path.is_dir()):
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_program(root: Path, name: str) -> tuple[str, str | None]:
    """A program's text as the agent left it, and why it cannot be loaded (None when it can): a missing file is
    the empty program (the load check says what is missing); a link, a folder, a special file, one over
    ``MAX_PROGRAM_BYTES`` or text that is not UTF-8 is refused with a sentence."""
    path = Path(root) / name
    if _is_link(path):
        return "", (f"{name} in the workspace is a symbolic link; programs are read only from regular files in "
                    f"the workspace: write the program itself")
    if not os.path.lexists(path):
        return "", None
    data = _read_regular(path, MAX_PROGRAM_BYTES + 1)
    if data is None:
        kind = "a folder" if path.is_dir() else "not a regular file"
        return "", f"{name} in the workspace is {kind}; write the program as an ordinary text file"
    if len(data) > MAX_PROGRAM_BYTES:
        return "", f"{name} is over {MAX_PROGRAM_BYTES} bytes; a program must be shorter"
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as error:
        return "", f"{name} is not UTF-8 text (byte {error.start} cannot be read); write it as UTF-8"


def sweep(root: Path, redaction: Callable[[str], str], keep: tuple[str, ...],
          max_files: int = MAX_FILES_PER_DECISION, max_bytes: int = MAX_BYTES_PER_DECISION) -> list[str]:
    """After a decision: remove links and special files, remove files past the limits (the ``keep`` files and
    ``.opal`` are never counted or removed), and put every file through the redaction. Returns a sentence per
    thing done (for the decision's transcript)."""
    root = Path(root)
    done: list[str] = []
    files: list[Path] = []
    for current, folders, names in os.walk(root):
        here = Path(current)
        for name in list(folders):
            if _is_link(here / name):
                (here / name).unlink()
                folders.remove(name)
                done.append(f"removed the link {(here / name).relative_to(root).as_posix()}")
        for name in names:
            path = here / name
            if _is_link(path) or not path.is_file():
                path.unlink()
                done.append(f"removed {path.relative_to(root).as_posix()} (a link or not a regular file)")
            else:
                files.append(path)
    counted, used = 0, 0
    for path in sorted(files):
        relative = path.relative_to(root).as_posix()
        size = path.stat().st_size
        if relative not in keep and not relative.startswith(META_FOLDER + "/"):
            if counted >= max_files or used + size > max_bytes:
                path.unlink()
                done.append(f"removed {relative}: past the {max_files} files or {max_bytes} bytes a decision may "
                            f"leave")
                continue
            counted, used = counted + 1, used + size
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")
        clean = redaction(text)
        if clean != text:
            write_file_here(path, clean.encode("utf-8", errors="surrogateescape"))
            done.append(f"redacted a secret in {relative}")
    return done


class WorkspaceMoved(Exception):
    """The agent host's workspace is no longer the folder it was at start; the message says so in one sentence."""


class FixedWorkspace:
    """The agent host's workspace: the folder given at start, the only one the host writes, sweeps, reads programs
    from or hands to a worker (module docstring)."""

    def __init__(self, given: str | os.PathLike):
        path = Path(given)
        if not path.is_absolute():
            raise WorkspaceMoved(f"the agent host's workspace must be an absolute path, not {str(given)!r}")
        real_folder(path)
        self.given = path
        self.root = Path(os.path.realpath(path))
        status = os.lstat(self.root)
        self.identity = (status.st_dev, status.st_ino)

    def checked(self) -> Path:
        """The workspace's real path, after checking that it is still the real folder it was at start; else
        ``WorkspaceMoved`` with the sentence."""
        try:
            status = os.lstat(self.root)
            same = (stat.S_ISDIR(status.st_mode) and (status.st_dev, status.st_ino) == self.identity
                    and os.path.realpath(self.root) == str(self.root))
        except OSError:
            same = False
        if not same:
            raise WorkspaceMoved(f"the agent host's workspace {self.root} is no longer the folder it was when the "
                                 f"host started (it was removed, replaced, or is reached through a link now); no "
                                 f"decision is worked anywhere else: start the run again")
        return self.root

    def put(self, programs: dict[str, str], facts_text: str, message: str) -> Path:
        """Write the running programs, the facts and the message into the checked workspace (a link or a folder in
        the place of one is replaced, never followed); returns its path."""
        root = self.checked()
        for name in PROGRAM_FILES:
            write_file_here(root / name, programs[name].encode("utf-8"))
        meta = real_folder(root / META_FOLDER)
        write_file_here(meta / FACTS, facts_text.encode("utf-8"))
        write_file_here(meta / MESSAGE, message.encode("utf-8"))
        return root

    def programs(self) -> tuple[dict[str, str], str | None]:
        """The programs as the agent left them in the checked workspace, and why they cannot be loaded (None: they
        can be tried); ``read_program``'s rules."""
        return programs_in(self.checked())


def programs_in(root: Path) -> tuple[dict[str, str], str | None]:
    """The programs in the workspace ``root`` as the agent left them, and why they cannot be loaded (None: they can
    be tried); each read with ``read_program``'s rules."""
    files, problems = {}, []
    for name in PROGRAM_FILES:
        files[name], problem = read_program(Path(root), name)
        if problem is not None:
            problems.append(problem)
    return files, "; ".join(problems) or None
