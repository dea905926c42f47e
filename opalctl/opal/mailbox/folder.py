"""A mailbox folder: the six file operations the mailbox is built on, and the local folder that does them.

``MailboxFolder`` is what the mailbox (``opalctl.opal.mailbox.box``) needs of the place it lives in: the same
methods are done on a folder of this machine (``LocalMailboxFolder``, a shared file system) or on a folder of
another machine reached with the ``ssh`` client (``opalctl.opal.mailbox.ssh``). Every path is relative to the
mailbox's root and '/'-separated, never absolute and never with a '..' part (``checked_parts`` refuses one).

``create`` is the one primitive the leases stand on: the file is written under a temporary name (starting with
'.', so ``names`` never lists it) in its own folder, flushed to the disk, then linked to its final name, which
fails when that name exists; two writers of one name cannot both succeed. ``replace`` renames over the name.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path, PurePosixPath
from typing import Protocol

from opalctl.errors import OpalctlError
from opalctl.files import NotAPlainFile, read_beneath


class MailboxRefusal(OpalctlError):
    """A file of the mailbox that is not read: a symbolic link, not a regular file, or over the size limit."""


class MailboxFolder(Protocol):
    """The file operations of a mailbox folder (module docstring); ``where`` names it for messages."""

    where: str

    def names(self, sub: str) -> list[str]:
        """The regular files of folder ``sub`` (none when it is missing), without temporary ('.') names."""

    def read(self, path: str, limit: int) -> bytes | None:
        """The file's bytes; None when it is missing; ``MailboxRefusal`` for a link, a file that is not regular, or
        one over ``limit`` bytes (never read past the limit)."""

    def create(self, path: str, data: bytes) -> bool:
        """Write the file only if it is absent, atomically; False when it exists."""

    def replace(self, path: str, data: bytes) -> None:
        """Write the file atomically over whatever it was."""

    def remove(self, path: str) -> None:
        """Remove the file; a missing one is fine."""

    def makedirs(self, sub: str) -> None:
        """Make folder ``sub`` and its parents."""


def checked_parts(path: str) -> tuple[str, ...]:
    """The parts of a mailbox path; ValueError for an absolute path, a '..' part or an empty path."""
    pure = PurePosixPath(path)
    parts = tuple(part for part in pure.parts if part not in ("", "."))
    if pure.is_absolute() or ".." in parts or not parts or "\x00" in path:
        raise ValueError(f"{path!r} is not a path inside the mailbox (relative, '/'-separated, no '..')")
    return parts


def temporary_name(name: str) -> str:
    """A fresh temporary name beside ``name`` (it starts with '.': ``names`` never lists it)."""
    return f".{name}.{secrets.token_hex(6)}.tmp"


class LocalMailboxFolder:
    """A mailbox folder on this machine (or a file system it shares with the cluster)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.where = str(self.root)

    def _path(self, path: str) -> Path:
        return self.root.joinpath(*checked_parts(path))

    def names(self, sub: str) -> list[str]:
        folder = self._path(sub)
        try:
            entries = list(os.scandir(folder)) if not folder.is_symlink() else []
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(entry.name for entry in entries
                      if not entry.name.startswith(".") and entry.is_file(follow_symlinks=False))

    def read(self, path: str, limit: int) -> bytes | None:
        try:
            return read_beneath(self.root, "/".join(checked_parts(path)), limit, single_name=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except NotAPlainFile as why:
            raise MailboxRefusal(f"{self.where}/{path} is not read: {why}") from None

    def _written(self, target: Path, data: bytes) -> Path:
        temporary = target.parent / temporary_name(target.name)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return temporary

    def create(self, path: str, data: bytes) -> bool:
        target = self._path(path)
        temporary = self._written(target, data)
        try:
            os.link(temporary, target, follow_symlinks=False)
            return True
        except FileExistsError:
            return False
        finally:
            temporary.unlink(missing_ok=True)

    def replace(self, path: str, data: bytes) -> None:
        target = self._path(path)
        temporary = self._written(target, data)
        try:
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def remove(self, path: str) -> None:
        target = self._path(path)
        try:
            if stat.S_ISDIR(os.lstat(target).st_mode):
                raise MailboxRefusal(f"{self.where}/{path} is a folder, not a file of the mailbox")
            target.unlink()
        except FileNotFoundError:
            pass

    def makedirs(self, sub: str) -> None:
        self._path(sub).mkdir(parents=True, exist_ok=True)
