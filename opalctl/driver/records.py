"""The run's per-update record, ``steps.jsonl.gz``, written so that a crash never leaves it unreadable.

The file is a sequence of complete gzip members (the gzip format allows concatenation; ``gzip.open`` reads
them as one stream). Lines are buffered and written as one member every ``FLUSH_LINES`` updates and at every
checkpoint, where the file is also fsynced. A crash can therefore only cut the last member short; the reader
stops at the last complete member. A checkpoint records how many lines the file held when it was written (always
the end of a member), and ``--resume`` cuts the file back to the end of that line (``locate``), so the file ends
up holding exactly one line per update, as if nothing had happened.

Each line carries the update's clock figures, its loss, a digest of the batch's row ids and a running digest of
every row seen so far (so two runs that saw the same rows in the same order end with the same digest).

Why so little happens in the training process. Inside the training loop, between two updates, the caches are
full of the model's work, and Python or torch work done there costs several times what it costs in a tight loop
(measured on ``digits``: the two row digests took about 11 us per update in the loop, 1.1 us on their own; a
per-update call that detached the loss and converted the ids took about 10 us more than appending a tuple).
So:

- per update, the loop only appends one tuple to ``pending`` (``StepsWriter.add`` says what it holds): the
  loss as a number when it lives on the CPU (reading it there is no synchronisation) and as a detached tensor
  elsewhere, and the row ids: the batch's own array when the sampler promises never to change it
  (``Sampler.fresh_ids``), else a copy (about 3.7 us in the loop on ``digits``, 0.6 % of an update);
- every ``FLUSH_LINES`` updates, the training process reads the kept losses (one transfer), adds the figures the
  run totals up (``take_sums``) and hands the raw numbers and ids to a helper process in one write to a pipe
  (about 0.9 us per line on ``digits``);
- the helper (this module, run as ``python -m opalctl.driver.records``) computes the digests, formats the lines,
  compresses and writes them (about 3.6 us per line, which the training process no longer spends), on another
  core where there is one, and never charged to a CPU budget (the process CPU clock does not count children).
  Measured in 24,000-update ``digits`` runs: the loop's time outside the timed updates fell from 12.3 to 10.7 us
  per update (checkpoints included: they now wait for the helper's reply).

The helper answers only when asked to make the file durable (``begin_sync``, at every checkpoint, and ``close``):
it fsyncs and replies with the file's length and the running digest. A checkpoint does not wait for that reply
before it encodes the run's state, since it records a line count, which the training process knows: the helper
writes and fsyncs the last lines while the state is encoded, and only the checkpoint's rename, which makes it
the one a resume reads, waits for the reply (``finish_sync``), so that no checkpoint ever counts lines the disk
may not hold. Measured in paired 12,000-update ``digits`` runs: the time the run spent on checkpoints fell from
109 to 79 ms (13 resume checkpoints and 4 stage ones).
When the training process dies, the helper reads the end of its input and exits without writing more; it holds
the run folder's lock while it lives, so no resumed run can cut the file back while it still writes.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opalctl.errors import OpalctlError
from opalctl.scalars import read_floats

FLUSH_LINES = 512
SEEN_START = "0" * 32
# a frame to the helper: kind (L: lines, S: make durable and reply, C: the same, then close), line count, id bytes;
# an L frame then holds six arrays of 8-byte numbers (update, charge, used, wall, loss, id bytes per line) and
# the ids of every line, as int64
_HEADER = struct.Struct("<cII")
_COLUMNS = 6
_READ_BYTES = 1 << 16  # how much of a steps file a reader decompresses at a time
PIPE_BYTES = 1 << 20  # the pipe's buffer, where the system allows it (Linux: /proc/sys/fs/pipe-max-size)


class StepsWriter:
    """Keeps the per-update records of a run and has a helper process write them (see the module docstring).

    It also keeps what the run totals from those records: the sums of the updates' wall seconds, CPU seconds
    (when the charges are CPU seconds), examples and non-finite losses since they were last taken
    (``take_sums``), and the last loss. ``lines`` counts the lines sent to the file, those it held at the start
    included (``offset``, ``seen`` and ``lines`` on resume come from ``locate``; the helper cuts the file
    back to ``offset``, 0 for a new run). ``seen``, the running digest of
    rows seen, is as of the last ``finish_sync`` or ``close``.
    """

    def __init__(self, path: Path, offset: int = 0, seen: str = SEEN_START, cpu_charges: bool = False,
                 inherit_fds: tuple[int, ...] = (), lines: int = 0):
        self.path = Path(path)
        self.lines = lines
        self.cpu_charges = cpu_charges  # the charges are CPU seconds (the cpu clock): each line's "cpu" is its charge
        # updates added since the last flush; the same list for the writer's whole life (emptied, never replaced),
        # so the loop may hold its bound ``append``
        self.pending: list[tuple] = []
        self.seen = seen
        self.sums = self._zero()
        self.last_loss = float("nan")
        package_root = str(Path(__file__).resolve().parents[2])  # the helper runs this very copy of opalctl
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        command = [sys.executable, "-m", "opalctl.driver.records", str(self.path),
                   str(int(offset)), seen, "cpu" if cpu_charges else "-"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=env, pass_fds=inherit_fds, bufsize=0)
        try:  # room for a whole flush (about 290 KB on digits), so that sending it never waits for the helper
            import fcntl

            fcntl.fcntl(self.process.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (ImportError, AttributeError, OSError):
            pass  # not Linux, or a lower system limit: sending then waits for the helper to read, nothing more
        self._reply()  # the helper has opened (and, on resume, cut back) the file, or says why it could not

    def add(self, update: int, charge: float, used: float, wall: float, loss, ids) -> None:
        """One update's line, kept as the tuple ``(update, charge, used, wall, loss, ids)``, sent every
        ``FLUSH_LINES``. ``loss`` is a number, or a scalar tensor read later with the others: only a detached one
        may be kept, since holding the loss itself would keep its autograd graph alive until the flush, moving the
        graph's teardown, a part of the update's cost, out of the timed interval. ``ids`` must not change until the
        flush: a copy of the batch's row ids, unless the sampler hands over a new array with each batch.

        The run's loop appends the same tuple to ``pending`` itself and checks the length, without this call:
        there, a call costs more than its work (see the module docstring)."""
        self.pending.append((update, charge, used, wall, loss, ids))
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
        """Send the pending lines to the helper, without waiting for it: read the kept losses (one transfer) and
        add up the sums.

        Only the lines a checkpoint counts need to reach the disk: after a crash the file is cut back to those
        anyway, so the periodic flushes in between neither wait nor fsync.
        """
        import numpy as np

        pending = self.pending
        if not pending:
            return
        updates, charges, used, walls, losses, ids = zip(*pending)
        losses = read_floats(list(losses))
        blob = np.concatenate(ids).astype(np.int64, copy=False).tobytes()  # the digests are of int64 bytes
        lengths = array("q", [8 * len(rows) for rows in ids])
        id_bytes = len(blob)
        sums = self.sums
        sums["train_wall"] += sum(walls)
        if self.cpu_charges:
            sums["train_cpu"] += sum(charges)
        sums["examples"] += id_bytes // 8
        sums["nonfinite_losses"] += sum(1 for loss in losses if loss - loss != 0.0)
        self.last_loss = losses[-1]
        self.lines += len(pending)
        self._write(b"".join([_HEADER.pack(b"L", len(pending), id_bytes), array("q", updates).tobytes(),
                              array("d", charges).tobytes(), array("d", used).tobytes(), array("d", walls).tobytes(),
                              array("d", losses).tobytes(), lengths.tobytes(), blob]))
        pending.clear()

    def begin_sync(self) -> None:
        """Send the pending lines and ask the helper to make the file durable; ``finish_sync`` waits for it."""
        self.flush()
        self._write(_HEADER.pack(b"S", 0, 0))

    def finish_sync(self) -> int:
        """Wait until every line sent before ``begin_sync`` is on the disk; bring ``seen`` up to date and return
        the file's length then."""
        return self._reply()

    def close(self) -> None:
        """Send the pending lines, wait until the file is complete on the disk, and end the helper."""
        if self.process.poll() is not None and self.process.stdin.closed:
            return
        self.flush()
        self._write(_HEADER.pack(b"C", 0, 0))
        self._reply()
        self._end()

    def abandon(self) -> None:
        """End the helper without waiting for the lines still pending (the run failed; a resume cuts them)."""
        self._end()

    def _end(self) -> None:
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            stream.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _write(self, data: bytes) -> None:
        try:
            self.process.stdin.write(data)
        except (BrokenPipeError, ValueError):
            self._failed()

    def _reply(self) -> int:
        line = self.process.stdout.readline()
        if not line:
            self._failed()
        answer = json.loads(line)
        if "error" in answer:
            self._end()
            raise OpalctlError(f"the run's steps records {self.path} cannot be written: {answer['error']}")
        self.seen = answer["seen"]
        return int(answer["offset"])

    def _failed(self) -> None:
        """The helper is gone: say why, in its own words when it left any."""
        try:
            answer = self.process.stdout.read() or b""
            stderr = self.process.stderr.read() or b""
        except ValueError:  # the writer was closed already: there is nothing more to read
            answer = stderr = b""
        self._end()
        for line in answer.decode(errors="replace").splitlines():
            if line.startswith('{"error"'):
                raise OpalctlError(f"the run's steps records {self.path} cannot be written: {json.loads(line)['error']}")
        last = (stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise OpalctlError(f"the process writing the run's steps records {self.path} stopped "
                           f"(exit status {self.process.returncode}: {last[:300]}); resume the run with --resume")


def format_lines(seen: str, cpu_charges: bool, updates, charges, used, walls, losses,
                 ids: list[bytes]) -> tuple[list[str], str]:
    """The lines of these updates, and the running digest after the last of them (``ids``: int64 bytes)."""
    sha256 = hashlib.sha256
    lines = []
    for update, charge, spent, wall, loss, rows_bytes in zip(updates, charges, used, walls, losses, ids):
        rows = sha256(rows_bytes).hexdigest()[:16]
        seen = sha256(f"{seen}:{rows}".encode()).hexdigest()[:32]
        # the clock figures are finite by construction (the meter refuses others); only the loss may not be
        if loss - loss == 0.0:
            lines.append(f'{{"charge":{charge!r},"cpu":{repr(charge) if cpu_charges else "null"},'
                         f'"loss":{loss!r},"rows":"{rows}","seen":"{seen}","update":{update},"used":{spent!r},'
                         f'"wall":{wall!r}}}')
        else:
            lines.append(json.dumps({"charge": charge, "cpu": charge if cpu_charges else None, "loss": loss,
                                     "rows": rows, "seen": seen, "update": update, "used": spent, "wall": wall},
                                    separators=(",", ":"), allow_nan=True, sort_keys=True))
    return lines, seen


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


def serve(path: str, offset: int, seen: str, cpu_charges: bool) -> int:
    """The helper process: write the lines it is sent, make the file durable and reply when asked."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run; the helper then sees its input end
    source, answers = sys.stdin.buffer, sys.stdout.buffer

    def reply(answer: dict) -> None:
        answers.write((json.dumps(answer) + "\n").encode())
        answers.flush()

    try:
        handle = open(path, "r+b" if os.path.exists(path) else "w+b")
        handle.truncate(offset)
        handle.seek(0, os.SEEK_END)
        reply({"offset": handle.tell(), "seen": seen})
        while True:
            header = _read_exactly(source, _HEADER.size)
            if header is None:
                return 0  # the run is gone: what is pending is cut by the resume anyway
            kind, count, id_bytes = _HEADER.unpack(header)
            if kind == b"L":
                body = _read_exactly(source, _COLUMNS * 8 * count + id_bytes)
                if body is None:
                    return 0
                view = memoryview(body)
                columns = [view[8 * count * k:8 * count * (k + 1)].cast("q" if k in (0, 5) else "d")
                           for k in range(_COLUMNS)]
                ids, start = [], _COLUMNS * 8 * count
                for length in columns[5]:
                    ids.append(body[start:start + length])
                    start += length
                lines, seen = format_lines(seen, cpu_charges, *columns[:5], ids)
                handle.write(gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=1, mtime=0))
                handle.flush()
            elif kind in (b"S", b"C"):
                os.fsync(handle.fileno())
                reply({"offset": handle.tell(), "seen": seen})
                if kind == b"C":
                    handle.close()
                    return 0
            else:
                reply({"error": f"the helper received an unknown request {kind!r}"})
                return 2
    except OSError as error:
        reply({"error": f"{error.strerror or error} ({path})"})
        return 1


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
    """Every complete line of a steps file; a member cut short by a crash is ignored."""
    for text, _end in _members(Path(path).read_bytes()):
        for line in text.decode().splitlines():
            if line:
                yield json.loads(line)


def locate(path: Path, lines: int) -> tuple[int, str]:
    """Where a steps file's first ``lines`` lines end, as a resume needs it: the byte offset to cut the file back
    to, and the running digest after the last of them. It reads the file from its start (0.05 s per 100,000 lines of
    ``digits``); a file that does not hold those lines whole, each numbered in turn, is refused in one sentence."""
    path = Path(path)
    if lines == 0:
        return 0, SEEN_START
    if not path.is_file():
        raise OpalctlError(f"the run's steps records {path} are missing, and its resume checkpoint counts {lines} "
                           f"lines in them; move the run folder aside and start the run again")
    count = 0
    for text, end in _members(path.read_bytes()):
        count += text.count(b"\n")
        if count == lines:
            last = json.loads(text[text.rstrip(b"\n").rfind(b"\n") + 1:])
            if last.get("update") != lines:
                break
            return end, last["seen"]
        if count > lines:
            break
    raise OpalctlError(f"the run's steps records {path} do not end a complete record at line {lines}, which its "
                       f"resume checkpoint counts (they were changed or cut short); move the run folder aside and "
                       f"start the run again")


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "cpu"))
