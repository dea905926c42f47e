"""The run's per-update record, ``steps.jsonl.gz``, written so that a crash never leaves it unreadable.

The file is a sequence of complete gzip members (the gzip format allows concatenation; ``gzip.open`` reads
them as one stream). Lines are buffered and written as one member every ``FLUSH_LINES`` updates and at every
checkpoint, where the file is also fsynced. A crash can therefore only cut the last member short; the reader
stops at the last complete member. A checkpoint records how many lines the file held when it was written (always
the end of a member), and ``--resume`` cuts the file back to the end of that line (``locate``), so the file ends
up holding exactly one line per update, as if nothing had happened.

Each line (``formats.step_line``) carries the update's clock figures, its loss, a digest of the batch's row ids
and a running digest of every row seen so far (so two runs that saw the same rows in the same order end with the
same digest).

Why so little happens in the training process. Inside the training loop, between two updates, the caches are
full of the model's work, and Python or torch work done there costs several times what it costs in a tight loop
(bench/README.md has the figures). So:

- per update, the loop only appends one ``formats.StepRow`` (as a plain tuple) to ``pending``: the loss as a
  number when it lives on the CPU (reading it there is no synchronisation) and as a detached tensor elsewhere,
  and the row ids: the batch's own array when the sampler promises never to change it (``Sampler.fresh_ids``),
  else a copy;
- every ``FLUSH_LINES`` updates, the training process reads the kept losses (one transfer), adds the figures the
  run totals up (``take_sums``) and hands the raw numbers and ids over in one frame;
- the frame goes to a helper process (this module, run as ``python -m opalctl.driver.records``) through a pipe;
  the helper computes the digests, formats the lines, compresses and writes them, on another core where there is
  one, and never charged to a CPU budget (the process CPU clock does not count children). Its plain twin,
  ``StepsWriter(..., in_process=True)``, handles the very same frames in the training process (same bytes, same
  digests; tested), for reading and for testing the fast path against.

The helper of an agent arm's run starts before the training process is confined, since no process can start
after (opalctl/sandbox.py), and opens its file only when its first frame says where the file continues: a resume
knows that only once its checkpoint is loaded, which runs agent code, after the confinement. Its path is fixed
when it starts, it opens it without following a link, and it confines itself as it starts (``HelperProcess``).

The helper answers only when asked to make the file durable (``begin_sync``, at every checkpoint, and ``close``):
it fsyncs and replies with the file's length, the running digest of rows (``seen``) and the sha256 of the file's
bytes so far. A checkpoint waits for that reply before it encodes the run's state: it carries the line count, the
rows digest and the bytes' sha256 of the lines it counts, so that no checkpoint ever counts lines the disk may not
hold, and a resume refuses a file rewritten since (``locate`` recomputes both; the file may be valid gzip with
the same number of lines and still not be the one the run wrote). When the training process dies, the helper
reads the end of its input and exits without writing more; it holds the run folder's lock while it lives, so no
resumed run can cut the file back while it still writes, and it ignores the signals that stop a run (SIGINT,
SIGTERM, SIGHUP, which a terminal sends the whole process group): the run stops, the helper then sees its input
end. A write the storage refuses (a full disk, a read-only folder) ends the run in the sentence of
``opalctl.files.storage``, naming this file.
"""

from __future__ import annotations

import errno
import fcntl
import gzip
import hashlib
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import zlib
from array import array
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from opalctl.errors import OpalctlError
from opalctl.files import CHUNK, read_plain, storage_fault
from opalctl.formats import STEPS_MAX_BYTES, StepRow, step_line
from opalctl.sandbox import Bounds, confine_process, training_paths
from opalctl.scalars import read_floats

FLUSH_LINES = 512
SEEN_START = "0" * 32
# A frame: a header (kind, line count, bytes after the columns) then, for kind L (lines), one column of 8-byte
# numbers per StepRow field, in StepRow's order, then the ids of every line as int64, then the learning rates of
# every line as doubles. The ``ids`` column holds each line's id bytes, the ``lrs`` column its number of learning
# rates (-1: None), so the header's third number is the id bytes and the learning rates' bytes together. Kinds: O open the file (first and once; its body, of the header's third number of bytes, is JSON:
# the offset to cut the file back to and the rows digest there), L lines, S make durable and reply, C the same,
# then close. The layout follows StepRow: a field added there without its code here stops the import.
_HEADER = struct.Struct("<cII")
_FIELD_CODES = {"update": "q", "charge": "d", "used": "d", "wall": "d", "loss": "d", "ids": "q", "lrs": "q"}
_CODES = tuple(_FIELD_CODES[name] for name in StepRow._fields)
_READ_BYTES = 1 << 16  # how much of a steps file a reader decompresses at a time
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # they stop the run, which then ends the helper
PIPE_BYTES = 1 << 20  # the pipe's buffer, where the system allows it (Linux: /proc/sys/fs/pipe-max-size)


def encode_lines(columns: dict[str, Any]) -> tuple[bytes, int]:
    """An L frame of these rows' columns (by StepRow field name, the losses read already), and how many row ids
    it holds."""
    import numpy as np  # here, not at the top: the steps helper process (this module) starts without numpy

    ids = columns["ids"]
    blob = np.concatenate(ids).astype(np.int64, copy=False).tobytes()  # the digests are of int64 bytes
    counts, rates = _learning_rates(columns.get("lrs") or [None] * len(ids))
    numbers = {**columns, "ids": [8 * len(rows) for rows in ids], "lrs": counts}
    parts = [_HEADER.pack(b"L", len(ids), len(blob) + 8 * len(rates))]
    parts += [array(code, numbers[name]).tobytes() for name, code in zip(StepRow._fields, _CODES)]
    parts += [blob, array("d", rates).tobytes()]
    return b"".join(parts), len(blob) // 8


def _learning_rates(column) -> tuple[list[int], list[float]]:
    """Each line's number of learning rates (-1: None) and all of them, one float each: a group's value that is
    not a number of exact type (a program's object, whose conversion would run its code) is NaN, written null."""
    counts: list[int] = []
    rates: list[float] = []
    for line in column:
        if line is None:
            counts.append(-1)
            continue
        counts.append(len(line))
        for rate in line:
            if type(rate) is float:
                rates.append(rate)
            else:
                from opalctl.opal.plain import plain_number  # here: the steps helper starts without torch

                number = plain_number(rate)
                rates.append(float("nan") if number is None else number)
    return counts, rates


def decode_lines(count: int, body: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """An L frame's columns by StepRow field name, and each line's ids as int64 bytes."""
    view = memoryview(body)
    columns = {name: view[8 * count * k:8 * count * (k + 1)].cast(code)
               for k, (name, code) in enumerate(zip(StepRow._fields, _CODES))}
    ids, start = [], len(_CODES) * 8 * count
    for length in columns["ids"]:
        ids.append(body[start:start + length])
        start += length
    rates = memoryview(body[start:]).cast("d")
    lrs, at = [], 0
    for number in columns["lrs"]:
        lrs.append(None if number < 0 else [None if r != r else r for r in rates[at:at + number]])
        at += max(number, 0)
    columns = {**columns, "lrs": lrs}
    return columns, ids


def frame_body_bytes(count: int, id_bytes: int) -> int:
    return len(_CODES) * 8 * count + id_bytes


def _body_bytes(kind: bytes, count: int, extra: int) -> int:
    """The length of the body that follows a frame's header."""
    return frame_body_bytes(count, extra) if kind == b"L" else extra if kind == b"O" else 0


def encode_open(offset: int, seen: str) -> bytes:
    """The O frame: where the file continues (0 and ``SEEN_START`` for a new run)."""
    body = json.dumps({"offset": int(offset), "seen": seen}).encode()
    return _HEADER.pack(b"O", 0, len(body)) + body


def steps_file_lines(seen: str, cpu_charges: bool, columns: dict[str, Any], ids: list[bytes]) -> tuple[list[str], str]:
    """The lines of these updates, and the running digest after the last of them (``ids``: int64 bytes)."""
    sha256 = hashlib.sha256
    lines = []
    for update, charge, spent, wall, loss, rows_bytes, lrs in zip(columns["update"], columns["charge"],
                                                                   columns["used"], columns["wall"], columns["loss"],
                                                                   ids, columns["lrs"]):
        rows = sha256(rows_bytes).hexdigest()[:16]
        seen = sha256(f"{seen}:{rows}".encode()).hexdigest()[:32]
        lines.append(step_line(update, charge, spent, wall, loss, rows, seen, cpu_charges, lrs))
    return lines, seen


class StepsFile:
    """The writing end, wherever it runs: the file cut back to ``offset``, the running digest of rows, the sha256
    of the file's bytes (those it kept first), and one method per frame kind."""

    def __init__(self, path: str, offset: int, seen: str, cpu_charges: bool):
        self.path = path
        self.seen = seen
        self.cpu_charges = cpu_charges
        self.handle = open_own_file(path)
        self.handle.truncate(offset)
        self.bytes_digest = hashlib.sha256()
        while block := self.handle.read(CHUNK):
            self.bytes_digest.update(block)
        self.handle.seek(0, os.SEEK_END)

    def state(self) -> dict[str, Any]:
        return {"offset": self.handle.tell(), "seen": self.seen, "sha256": self.bytes_digest.hexdigest()}

    def write(self, count: int, body: bytes) -> None:
        columns, ids = decode_lines(count, body)
        lines, self.seen = steps_file_lines(self.seen, self.cpu_charges, columns, ids)
        member = gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=1, mtime=0)
        self.handle.write(member)
        self.handle.flush()
        self.bytes_digest.update(member)

    def sync(self) -> dict[str, Any]:
        os.fsync(self.handle.fileno())
        return self.state()

    def close(self) -> None:
        self.handle.close()


def open_own_file(path: str):
    """``path`` opened for reading and writing (made when missing), never through a link and only as a regular
    file with one name: the helper may hold more rights than the training process that names its file
    (``HelperProcess``), so what lies at the path must be the run's own file, not a link planted there."""
    not_own = OSError(errno.EINVAL, "a link, a folder or a file with another name too lies there, where the run "
                                    "writes only a file of its own")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                     0o644)
    except OSError as error:
        raise (not_own if error.errno in (errno.ELOOP, errno.EISDIR) else error) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise not_own
    os.set_blocking(fd, True)  # O_NONBLOCK only kept a fifo from holding the open
    return os.fdopen(fd, "r+b")


class HelperProcess:
    """The fast path: a helper process writes the frames it reads from a pipe (see the module docstring).

    It starts before the file is opened (the O frame opens it), so that it can start before the training process
    is confined, which can then start no process (opalctl/sandbox.py), and still cut the file back to where a
    resume checkpoint, loaded after the confinement, says it continues. The path is fixed when it starts: the
    training process, where agent code runs by then, cannot point it elsewhere, and the file is opened without
    following a link (``open_own_file``). ``confine``: the helper confines itself as it starts, writing only
    beside its file, starting no process and holding no capability."""

    def __init__(self, path: Path, cpu_charges: bool, inherit_fds: tuple[int, ...], confine: bool = False):
        self.path = path
        package_root = str(Path(__file__).resolve().parents[2])  # the helper runs this very copy of opalctl
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        command = [sys.executable, "-m", "opalctl.driver.records", str(path), "cpu" if cpu_charges else "-",
                   "confine" if confine else "-"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=env, pass_fds=inherit_fds, bufsize=0)
        try:  # room for a whole flush, so that sending it never waits for the helper
            fcntl.fcntl(self.process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (AttributeError, OSError):
            pass  # not Linux, or a lower system limit: sending then waits for the helper to read, nothing more

    @property
    def ended(self) -> bool:
        return self.process.poll() is not None and self.process.stdin.closed

    def send(self, data: bytes) -> None:
        try:
            self.process.stdin.write(data)
        except (BrokenPipeError, ValueError):
            self._failed()

    def receive(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            self._failed()
        return json.loads(line)

    def end(self) -> None:
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                self.process.kill()
            except PermissionError:  # a confined training process cannot signal it (sandbox.py): it is left to
                return  # end with its input, as it does
            self.process.wait()

    def _failed(self) -> None:
        """The helper is gone: say why, in its own words when it left any."""
        try:
            answer = self.process.stdout.read() or b""
            stderr = self.process.stderr.read() or b""
        except ValueError:  # the writer was closed already: there is nothing more to read
            answer = stderr = b""
        self.end()
        for line in answer.decode(errors="replace").splitlines():
            if line.startswith('{"error"'):
                raise write_failure(self.path, json.loads(line))
        last = (stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise OpalctlError(f"the process writing the run's steps records {self.path} stopped "
                           f"(exit status {self.process.returncode}: {last[:300]}); resume the run with --resume")


class InProcess:
    """The plain twin of ``HelperProcess``: the same frames, handled here by the same ``WritingEnd`` (``confine``
    is the helper's: here the frames are handled in the process the run itself confines)."""

    def __init__(self, path: Path, cpu_charges: bool, inherit_fds: tuple[int, ...] = (), confine: bool = False):
        self.path = path
        self.answers: deque[dict[str, Any]] = deque()
        self.writing = WritingEnd(str(path), cpu_charges)
        self.ended = False

    def send(self, data: bytes) -> None:
        if self.ended:
            raise OpalctlError(f"the writer of the run's steps records {self.path} stopped; resume the run with "
                               f"--resume")
        position = 0
        while position < len(data):
            kind, count, extra = _HEADER.unpack_from(data, position)
            position += _HEADER.size
            body = data[position:position + _body_bytes(kind, count, extra)]
            position += len(body)
            try:
                answer = self.writing.handle(kind, count, body)
            except OSError as error:  # as the helper answers it
                self.end()
                if kind == b"O":  # the helper replies, and the reply is the sentence
                    self.answers.append(_os_error(error, str(self.path)))
                    return
                raise write_failure(self.path, _os_error(error, str(self.path))) from None
            if answer is not None:
                self.answers.append(answer)

    def receive(self) -> dict[str, Any]:
        return self.answers.popleft()

    def end(self) -> None:
        if not self.ended:
            self.writing.close()
        self.ended = True


def _os_error(error: OSError, path: str) -> dict[str, Any]:
    """A write error as the helper answers it."""
    return {"error": f"{error.strerror or error} ({path})", "errno": error.errno, "reason": error.strerror or ""}


def write_failure(path: Path, answer: dict[str, Any]) -> OpalctlError:
    """The writing end's error answer as the error the run ends with: the storage's refusal in the sentence every
    writer uses (``opalctl.files.storage``), anything else as it was said."""
    return (storage_fault(path, answer.get("errno"), answer.get("reason", ""))
            or OpalctlError(f"the run's steps records {path} cannot be written: {answer['error']}"))


class WritingEnd:
    """What the writing end does with each frame, in the helper or in its twin: the file's path is fixed when it
    starts, the O frame opens it (once, first), the others write and sync it."""

    def __init__(self, path: str, cpu_charges: bool):
        self.path = path
        self.cpu_charges = cpu_charges
        self.file: StepsFile | None = None

    def handle(self, kind: bytes, count: int, body: bytes) -> dict[str, Any] | None:
        """One frame; the reply it asks for, if any (a C frame also closes the file). A refused write raises."""
        if kind == b"O":
            if self.file is not None:
                return {"error": "the helper was asked to open the file a second time"}
            where = _open_request(body)
            if where is None:
                return {"error": f"the helper received an open request it cannot read: {body[:100]!r}"}
            self.file = StepsFile(self.path, where[0], where[1], self.cpu_charges)
            return self.file.state()
        if self.file is None:
            return {"error": f"the helper received {kind!r} before the file was opened"}
        if kind == b"L":
            self.file.write(count, body)
            return None
        if kind in (b"S", b"C"):
            answer = self.file.sync()
            if kind == b"C":
                self.close()
            return answer
        return {"error": f"the helper received an unknown request {kind!r}"}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _open_request(body: bytes) -> tuple[int, str] | None:
    """The offset and rows digest of an O frame, or None when they are not a byte offset and a digest."""
    try:
        request = json.loads(body)
        offset, seen = request["offset"], request["seen"]
    except (ValueError, TypeError, KeyError):
        return None
    if type(offset) is not int or offset < 0 or not isinstance(seen, str) or len(seen) != len(SEEN_START) \
            or any(char not in "0123456789abcdef" for char in seen):
        return None
    return offset, seen


class StepsWriter:
    """Keeps the per-update records of a run and has them written (see the module docstring).

    It also keeps what the run totals from those records: the sums of the updates' wall seconds, CPU seconds
    (when the charges are CPU seconds), examples and non-finite losses since they were last taken
    (``take_sums``), and the last loss. ``lines`` counts the lines sent to the file, those it held at the start
    included (``offset``, ``seen`` and ``lines`` on resume come from ``locate``; the writing end cuts the file
    back to ``offset``, 0 for a new run). ``seen``, the running digest of rows seen, and ``sha256``, the digest of
    the file's bytes, are as of the last ``finish_sync`` or ``close``. ``in_process`` chooses the plain twin over
    the helper process.

    ``StepsWriter(path, ...)`` starts the writing end and opens the file at once. A run that confines its training
    process starts it first (``StepsWriter.started``, before the confinement, after which no process can start)
    and opens the file later (``open``, once a resume checkpoint has said where the file continues).
    """

    def __init__(self, path: Path, offset: int = 0, seen: str = SEEN_START, cpu_charges: bool = False,
                 inherit_fds: tuple[int, ...] = (), lines: int = 0, in_process: bool = False):
        self._start(path, cpu_charges, inherit_fds, in_process, confine=False)
        self.open(offset, seen, lines)

    @classmethod
    def started(cls, path: Path, cpu_charges: bool = False, inherit_fds: tuple[int, ...] = (),
                in_process: bool = False, confine: bool = False) -> StepsWriter:
        """The writing end started, waiting for ``open`` to name where the file continues; ``confine``: the helper
        confines itself as it starts (``HelperProcess``)."""
        writer = cls.__new__(cls)
        writer._start(path, cpu_charges, inherit_fds, in_process, confine)
        return writer

    def _start(self, path: Path, cpu_charges: bool, inherit_fds: tuple[int, ...], in_process: bool,
               confine: bool) -> None:
        self.path = Path(path)
        self.lines = 0
        self.opened = False
        self.cpu_charges = cpu_charges  # the charges are CPU seconds (the cpu clock): each line's "cpu" is its charge
        # updates added since the last flush; the same list for the writer's whole life (emptied, never replaced),
        # so the loop may hold its bound ``append``
        self.pending: list[tuple] = []
        self.seen = SEEN_START
        self.sha256 = ""  # the sha256 of the file's bytes, as of the last reply
        self.sums = self._zero()
        self.last_loss = float("nan")
        end = InProcess if in_process else HelperProcess
        self.channel = end(self.path, cpu_charges, inherit_fds, confine=confine)

    def open(self, offset: int = 0, seen: str = SEEN_START, lines: int = 0) -> None:
        """Open the file, cut back to ``offset`` (0 for a new run), its rows digest ``seen`` there and ``lines``
        lines before it (``locate``'s figures on resume); wait until it is open, or raise the sentence saying why
        it could not be."""
        if self.opened:
            raise RuntimeError(f"the steps records {self.path} are open already")
        self.lines, self.seen = lines, seen
        self.channel.send(encode_open(offset, seen))
        self._reply()
        self.opened = True

    @property
    def process(self) -> subprocess.Popen:
        """The helper process (the fast path only)."""
        return self.channel.process

    def add(self, update: int, charge: float, used: float, wall: float, loss, ids, lrs=None) -> None:
        """One update's line, kept as a ``StepRow`` tuple, sent every ``FLUSH_LINES``. ``loss`` is a number, or a
        scalar tensor read later with the others: only a detached one may be kept, since holding the loss itself
        would keep its autograd graph alive until the flush, moving the graph's teardown, a part of the update's
        cost, out of the timed interval. ``ids`` must not change until the flush: a copy of the batch's row ids,
        unless the sampler hands over a new array with each batch.

        The run's loop appends the same tuple to ``pending`` itself and checks the length, without this call:
        there, a call costs more than its work (see the module docstring)."""
        self.pending.append((update, charge, used, wall, loss, ids, lrs))
        if len(self.pending) >= FLUSH_LINES:
            self.flush()

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"train_wall": 0.0, "train_cpu": 0.0, "examples": 0, "nonfinite_losses": 0}

    def take_sums(self) -> dict[str, float]:
        """Send what is pending, and hand over the sums of the updates sent since the last call."""
        self.flush()
        sums, self.sums = self.sums, self._zero()
        return sums

    def flush(self) -> None:
        """Send the pending lines, without waiting for them to be written: read the kept losses (one transfer)
        and add up the sums.

        Only the lines a checkpoint counts need to reach the disk: after a crash the file is cut back to those
        anyway, so the periodic flushes in between neither wait nor fsync.
        """
        pending = self.pending
        if not pending:
            return
        if not self.opened:
            raise RuntimeError(f"lines sent before the steps records {self.path} were opened")
        columns = dict(zip(StepRow._fields, zip(*pending)))
        losses = columns["loss"] = read_floats(list(columns["loss"]))
        frame, examples = encode_lines(columns)
        sums = self.sums
        sums["train_wall"] += sum(columns["wall"])
        if self.cpu_charges:
            sums["train_cpu"] += sum(columns["charge"])
        sums["examples"] += examples
        sums["nonfinite_losses"] += sum(1 for loss in losses if loss - loss != 0.0)
        self.last_loss = losses[-1]
        self.lines += len(pending)
        self.channel.send(frame)
        pending.clear()

    def begin_sync(self) -> None:
        """Send the pending lines and ask for the file to be made durable; ``finish_sync`` waits for it."""
        self.flush()
        self.channel.send(_HEADER.pack(b"S", 0, 0))

    def finish_sync(self) -> int:
        """Wait until every line sent before ``begin_sync`` is on the disk; bring ``seen`` up to date and return
        the file's length then."""
        return self._reply()

    def close(self) -> None:
        """Send the pending lines, wait until the file is complete on the disk, and end the writing end."""
        if self.channel.ended:
            return
        if not self.opened:  # started, never opened: nothing to make durable
            self.channel.end()
            return
        self.flush()
        self.channel.send(_HEADER.pack(b"C", 0, 0))
        self._reply()
        self.channel.end()

    def abandon(self) -> None:
        """End the writing end without waiting for the lines still pending (the run failed; a resume cuts them)."""
        self.channel.end()

    def _reply(self) -> int:
        answer = self.channel.receive()
        if "error" in answer:
            self.channel.end()
            raise write_failure(self.path, answer)
        self.seen, self.sha256 = answer["seen"], answer["sha256"]
        return int(answer["offset"])


def _read_exactly(stream, size: int) -> bytes | None:
    """``size`` bytes, or None when the input ends first (the training process is gone)."""
    parts, left = [], size
    while left:
        part = stream.read(left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def serve(path: str, cpu_charges: bool, confine: bool = False) -> int:
    """The helper process: open the file when asked (``WritingEnd``), write the lines it is sent, make the file
    durable and reply when asked; ``confine``: first confine itself (``confine_helper``)."""
    for number in STOP_SIGNALS:  # they stop the run; the helper then sees its input end
        signal.signal(number, signal.SIG_IGN)
    if confine:
        confine_helper(path)
    source, answers = sys.stdin.buffer, sys.stdout.buffer
    writing = WritingEnd(path, cpu_charges)

    def reply(answer: dict) -> None:
        answers.write((json.dumps(answer) + "\n").encode())
        answers.flush()

    try:
        while True:
            header = _read_exactly(source, _HEADER.size)
            if header is None:
                return 0  # the run is gone: what is pending is cut by the resume anyway
            kind, count, extra = _HEADER.unpack(header)
            body = _read_exactly(source, _body_bytes(kind, count, extra))
            if body is None:
                return 0
            answer = writing.handle(kind, count, body)
            if answer is not None:
                reply(answer)
                if "error" in answer:
                    return 2
                if kind == b"C":
                    return 0
    except OSError as error:
        reply(_os_error(error, path))
        return 1


def confine_helper(path: str) -> dict:
    """The helper's own confinement, as it starts (before it reads a frame): it writes only in its file's folder,
    reads what a training process reads, reaches no network, starts no process and holds no capability."""
    return confine_process(writable=[Path(path).parent], readable=training_paths(), deny_network=True,
                           bounds=Bounds(no_processes=True, drop_capabilities=True)).to_json()


def _members(data: bytes) -> Iterator[tuple[bytes, int]]:
    """Each complete gzip member's text and the offset where it ends; a member cut short by a crash ends it.
    The data is fed in slices of a memoryview, so a long file is read once, never copied member by member."""
    view, position = memoryview(data), 0
    while position < len(data):
        decompressor, parts = zlib.decompressobj(wbits=31), []
        while not decompressor.eof:
            if position >= len(data):
                return
            piece = view[position:position + _READ_BYTES]
            try:
                parts.append(decompressor.decompress(piece))
            except zlib.error:
                return
            position += len(piece)
        position -= len(decompressor.unused_data)
        yield b"".join(parts), position


def read_steps(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete line of a steps file; a member cut short by a crash is ignored. The file is read as every
    file opalctl reads back (``files.read_plain``): a FIFO, a device or a link there is an ``OSError``."""
    for text, _end in _members(read_plain(path, STEPS_MAX_BYTES)):
        for line in text.decode().splitlines():
            if line:
                yield json.loads(line)


class StepsEnd(NamedTuple):
    """Where a steps file's first lines end: the byte offset, the rows digest and the sha256 of the bytes there."""

    offset: int
    seen: str
    sha256: str


def locate(path: Path, lines: int) -> StepsEnd:
    """Where a steps file's first ``lines`` lines end, as a resume needs it: the byte offset to cut the file back
    to, the running digest of rows after the last of them, and the sha256 of the file's bytes up to there (a
    resume compares both digests with those its checkpoint carries). It reads the file from its start; a file that
    does not hold those lines whole, each numbered in turn, is refused in one sentence."""
    path = Path(path)
    if lines == 0:
        return StepsEnd(0, SEEN_START, hashlib.sha256(b"").hexdigest())
    if not path.is_file():
        raise OpalctlError(f"the run's steps records {path} are missing, and its resume checkpoint counts {lines} "
                           f"lines in them; start the run again from update 0 with --restart (what it wrote is kept "
                           f"aside)")
    count, data = 0, path.read_bytes()
    for text, end in _members(data):
        count += text.count(b"\n")
        if count == lines:
            last = json.loads(text[text.rstrip(b"\n").rfind(b"\n") + 1:])
            if last.get("update") != lines:
                break
            return StepsEnd(end, last["seen"], hashlib.sha256(memoryview(data)[:end]).hexdigest())
        if count > lines:
            break
    raise OpalctlError(f"the run's steps records {path} do not end a complete record at line {lines}, which its "
                       f"resume checkpoint counts (they were changed or cut short); start the run again from update 0 "
                       f"with "
                       f"--restart (what it wrote is kept aside)")


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2] == "cpu", sys.argv[3] == "confine"))
