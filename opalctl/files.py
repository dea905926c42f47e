"""Small file helpers every part of opalctl shares: hashing, canonical JSON and atomic writes.

A record that is half written is worse than no record, so every file opalctl produces is written to a
temporary name in the same folder, flushed and fsynced, then renamed over the target (rename is atomic on
POSIX), and the folder is fsynced so the rename itself survives a crash.

A write the storage refuses (a full disk, a used-up quota, a read-only folder, a file where a folder must be) is
told in one sentence naming the file and the way on (``storage``), never as an internal error: every atomic write
goes through it, and so does any writer that holds a file open (the steps records). A run's sentence ends with the
command that resumes it; every other command that writes (init, freeze, report, export, show --html) says its own
way on (``then``), which also rewords a fault raised by a write inside its block.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from opalctl.errors import StorageFault

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            block = handle.read(CHUNK)
            if not block:
                break
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_record(path: Path, relative_to: Path) -> dict[str, Any]:
    """The lock's record of one file: where it is (relative to the lock's folder), its size and its digest."""
    return {
        "path": os.path.relpath(os.path.abspath(path), os.path.abspath(relative_to)),
        "bytes": os.path.getsize(path),
        "sha256": sha256_file(path),
    }


def canonical_json(value: Any) -> str:
    """Sorted keys, two-space indent, a final newline: the same value always gives the same bytes."""
    return json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


# what the storage says, and what frees it: a full disk or quota wants space, a refused write a writable folder
_FULL = "free space there"
_WRITABLE = "make the folder writable"
STORAGE_ERRNOS = {errno.ENOSPC: ("the disk is full", _FULL), errno.EDQUOT: ("the disk quota is used up", _FULL),
                  errno.EROFS: ("the file system is read-only", _WRITABLE),
                  errno.EACCES: ("writing is not permitted", _WRITABLE),
                  errno.EPERM: ("writing is not permitted", _WRITABLE)}
# a file where a folder must be (or a folder where a file must be): the path is what is refused
IN_THE_WAY_ERRNOS = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR)
RUN_CONTINUES = f"{StorageFault.CONTINUE} the run"  # what a run's sentence ends with (errors.StorageFault)


def _in_the_way(path: str | os.PathLike, number: int | None) -> str | None:
    """What stands in the way of writing ``path`` when the refusal ``number`` says one thing is where another must
    be: the first of ``path``'s folders that is not a folder, or ``path`` itself when it is a folder."""
    if number not in IN_THE_WAY_ERRNOS:
        return None
    target = Path(path)
    if number == errno.EISDIR and target.is_dir():
        return f"{target} is a folder, not a file"
    for place in reversed([target, *target.parents]):
        if os.path.lexists(place) and not place.is_dir():
            return f"{place} is a file, not a folder"
    return None


def storage_fault(path: str | os.PathLike, number: int | None, reason: str = "",
                  then: str = RUN_CONTINUES) -> StorageFault | None:
    """The one sentence for a write of ``path`` the storage refused with ``number`` (an errno), or None when
    ``number`` is not the storage's refusal; ``then``: what continues once the cause is gone (a run's resume line,
    by default; a command that is not a run says to run it again)."""
    if number in STORAGE_ERRNOS:
        what, remedy = STORAGE_ERRNOS[number]
        said = f" ({reason})" if reason else ""
        fault = StorageFault(f"cannot write {path}: {what}{said}; {remedy}, then {then}")
    else:
        blocked = _in_the_way(path, number)
        if blocked is None:
            return None
        fault = StorageFault(f"cannot write {path}: {blocked}; move it away or choose another place, then {then}")
    fault.then = then
    return fault


@contextlib.contextmanager
def storage(path: str | os.PathLike, then: str | None = None) -> Iterator[None]:
    """Turn the storage's refusal of a write inside the block into a ``StorageFault`` naming ``path``; any other
    OSError passes unchanged. ``then``: what continues once the cause is gone, for a command that is not a run
    (a fault raised by a write inside the block is told with it too); by default a run's resume line."""
    try:
        yield
    except StorageFault as fault:
        inner = fault.then or RUN_CONTINUES  # a fault from another process brings its words alone
        if then is None or not fault.message.endswith(inner):
            raise
        reworded = StorageFault(fault.message.removesuffix(inner) + then, details=fault.details)
        reworded.then = then  # the outermost command's way on is the one told
        raise reworded from None
    except OSError as error:
        fault = storage_fault(path, error.errno, error.strerror or "", then=then or RUN_CONTINUES)
        if fault is None:
            raise
        raise fault from None


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True,
                       before_replace: Callable[[], object] | None = None) -> None:
    """Write via a temporary file and a rename; ``durable`` also fsyncs file and folder (skip it only for records
    whose loss in a power cut is harmless, such as an agent's decision transcripts). ``before_replace`` runs once
    the temporary file is written, just before the rename: it waits for whatever must be on the disk before this
    file may replace the old one (the records a checkpoint counts); when it raises, the old file stays. A write
    the storage refuses is a ``StorageFault`` naming ``path`` (and leaves no temporary file)."""
    target = Path(path)
    with storage(target):
        _write_replace(target, data, durable, before_replace)


def _write_replace(target: Path, data: bytes, durable: bool, before_replace: Callable[[], object] | None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    if durable:
        _fsync_folder(target.parent)


def atomic_write_text(path: str | os.PathLike, text: str, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), durable=durable)


def atomic_write_json(path: str | os.PathLike, value: Any, durable: bool = True) -> None:
    atomic_write_text(path, canonical_json(value), durable=durable)


class NotAPlainFile(OSError):
    """``read_beneath`` refused a file: the clause says why (a link on the way, not a regular file, ...)."""


def read_beneath(root: str | os.PathLike, relative: str, limit: int, single_name: bool = True) -> bytes:
    """The bytes of the file ``relative`` names beneath the folder ``root``, read without following a link on the
    way (every folder and the file itself are opened with ``O_NOFOLLOW`` from the one before) and only when it is a
    regular file with one name (a hard link to a file elsewhere is refused too) of at most ``limit`` bytes. A
    process that trusts no path of the folder's writer reads through this: what it reads is what lies there, and
    the bytes it hashes are the bytes it then uses. Raises ``FileNotFoundError`` when it is missing and
    ``NotAPlainFile`` (with the clause) when it is refused. ``single_name=False`` reads a file of several names (a
    mailbox's file is linked into place from its temporary name, and has two for a moment)."""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        raise NotAPlainFile(f"{relative!r} is not a path beneath the folder")
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):  # a link gives one or the other with O_DIRECTORY
                    link = stat.S_ISLNK(os.lstat(part, dir_fd=folder).st_mode)
                    raise NotAPlainFile(f"{part} on the way is {'a symbolic link' if link else 'not a folder'}") \
                        from None
                raise
            os.close(folder)
            folder = inner
        fd = _open_plain(parts[-1], folder)
    finally:
        os.close(folder)
    return _read_plain_fd(fd, limit, single_name=single_name)


def _open_plain(path: str | os.PathLike, dir_fd: int | None = None) -> int:
    """A descriptor of the regular file ``path``, opened without following a link and without blocking (a FIFO
    opens at once, and is then refused by ``_read_plain_fd`` as not a regular file, never waited on)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise NotAPlainFile("it is a symbolic link") from None
        if error.errno == errno.ENXIO:  # a socket, or a FIFO on a system that refuses to open it without a writer
            raise NotAPlainFile("it is not a regular file") from None
        raise


def _read_plain_fd(fd: int, limit: int, single_name: bool) -> bytes:
    """The bytes behind ``fd`` (closed here), when it is a regular file of at most ``limit`` bytes (with
    ``single_name``, of one name too); else ``NotAPlainFile``. The status is taken from the open descriptor, so
    what is checked is what is read."""
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise NotAPlainFile("it is not a regular file")
        if single_name and status.st_nlink != 1:
            raise NotAPlainFile(f"it has {status.st_nlink} names (a hard link)")
        if status.st_size > limit:
            raise NotAPlainFile(f"it is {status.st_size} bytes, over the limit of {limit}")
        # what fstat says it holds, and one byte more to see it grew (never ``limit`` bytes asked for at once: a
        # read allocates what it is asked for)
        parts = [handle.read(status.st_size + 1)]
        size = len(parts[0])
        while size > status.st_size and size <= limit and parts[-1]:
            parts.append(handle.read(min(CHUNK, limit + 1 - size)))
            size += len(parts[-1])
        data = b"".join(parts)
    if len(data) > limit:
        raise NotAPlainFile(f"it grew past the limit of {limit} bytes while it was read")
    return data


def read_plain(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, of at most ``limit`` bytes: the one read of every file opalctl did
    not just write itself (a lock, a run's records, the agent's events and programs). A link there, a FIFO (which
    is never waited on), a device such as /dev/zero or a file over the limit is refused (``NotAPlainFile`` with the
    clause) before anything is read; ``FileNotFoundError`` when it is missing. Unlike ``read_beneath`` the folders
    on the way are the caller's to trust, and a file with more than one name reads."""
    return _read_plain_fd(_open_plain(path), limit, single_name=False)


def open_plain(path: str | os.PathLike) -> BinaryIO:
    """An open binary handle of the regular file ``path``, for a reader that reads it in parts (a hash, a file
    followed as it grows); refused as ``read_plain`` refuses, whatever its size."""
    handle = os.fdopen(_open_plain(path), "rb")
    if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
        handle.close()
        raise NotAPlainFile("it is not a regular file")
    return handle


def plain_sha256(path: str | os.PathLike) -> str:
    """The sha256 of the regular file ``path`` (refused as ``read_plain`` refuses, whatever its size)."""
    digest = hashlib.sha256()
    with open_plain(path) as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


MAX_JSON_DEPTH = 64  # the deepest nesting of a record opalctl reads back (its own go a few levels deep)


class JSONRefused(ValueError):
    """``decode_json`` refused the bytes: the clause says why (not UTF-8, not JSON, nested too deep)."""


def _finite(text: str) -> float:
    value = float(text)
    if value - value != 0.0:
        raise JSONRefused(f"holds the number {text}, which is not finite")
    return value


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"holds {name}, which strict JSON has not")


def decode_json(data: bytes, max_depth: int = MAX_JSON_DEPTH, finite: bool = False) -> Any:
    """``data`` as JSON, nested at most ``max_depth`` deep (and with ``finite``, strict JSON: no NaN, no
    Infinity, no number too large for a float, as ``canonical_json`` writes); ``JSONRefused`` (a clause: "is not
    JSON ...") otherwise. JSON nested a hundred thousand deep is refused here, never a RecursionError further on."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JSONRefused("is not UTF-8 text") from None
    strict = {"parse_float": _finite, "parse_constant": _no_constant} if finite else {}
    try:
        value = json.loads(text, **strict)
    except JSONRefused:
        raise
    except RecursionError:
        raise JSONRefused(f"is nested deeper than {max_depth} levels") from None
    except ValueError:
        raise JSONRefused("is not JSON (cut short or damaged)") from None
    if json_depth(value) > max_depth:
        raise JSONRefused(f"is nested deeper than {max_depth} levels")
    return value


def json_depth(value: Any) -> int:
    """How deep ``value`` nests (a scalar 0, ``[]`` 1), walked without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest


def read_json(path: str | os.PathLike, limit: int, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The JSON in the regular file ``path`` (``read_plain``, then ``decode_json``): raises what they raise."""
    return decode_json(read_plain(path, limit), max_depth)


def size_text(count: int) -> str:
    """``count`` bytes as a sentence says it (``2.0 GiB``, ``50.0 MiB``, ``24.0 KiB``, ``512 bytes``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    return f"{count} bytes"
