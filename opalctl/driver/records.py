"""The run's per-update record, ``steps.jsonl.gz``, written so that a crash never leaves it unreadable.

The file is a sequence of complete gzip members (the gzip format allows concatenation; ``gzip.open`` reads
them as one stream). Lines are buffered in memory and written as one member, flushed and fsynced, every
``FLUSH_LINES`` updates and at every checkpoint. A crash can therefore only cut the last member short; the
reader stops at the last complete member, and ``--resume`` truncates the file to the offset recorded in the
checkpoint it resumes from, so the file ends up holding exactly one line per update, as if nothing had happened.

Each line carries the update's clock figures, its loss, a digest of the batch's row ids and a running digest of
every row seen so far (so two runs that saw the same rows in the same order end with the same digest).

Why the work waits for the flush: inside the training loop, between two updates, the caches are full of the
model's work, and Python or torch work done there costs several times what it costs in a tight loop (measured on
``digits``, in ``bench/driver_overhead.py`` and in same-process A/B runs: the two row digests took about 11 us per
update in the loop, 1.1 us on their own; a per-update ``add`` call that detached the loss and converted the ids
took about 10 us more than appending a tuple). So per update the loop only appends one tuple to ``pending``
(``add`` says what it holds): the loss as a number when it lives on the CPU (reading it there is no
synchronisation) and as a detached tensor elsewhere (read with the others in one transfer at the flush), and the
row ids: the batch's own array when the sampler promises never to change it (``Sampler.fresh_ids``), else a copy
(in the loop a copy costs about 3.7 us on ``digits``, 0.6 % of an update). ``settle`` computes the digests, the running digest and the lines of every kept update at
once, and every flush settles first.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from opalctl.scalars import read_floats

FLUSH_LINES = 512
SEEN_START = "0" * 32
_INT64 = np.dtype(np.int64)


class StepsWriter:
    """Buffers the per-update lines and writes them as gzip members. It also keeps what the run totals from
    those lines: the running digest of rows seen (``seen``, starting from the value given: a checkpoint's, on
    resume), the last loss, and the sums of the updates' wall seconds, CPU seconds (lines that carry them),
    examples and non-finite losses since they were last taken (``take_sums``)."""

    def __init__(self, path: Path, offset: int | None = None, seen: str = SEEN_START, cpu_charges: bool = False):
        self.path = Path(path)
        self.cpu_charges = cpu_charges  # the charges are CPU seconds (the cpu clock): each line's "cpu" is its charge
        self.lines: list[str] = []  # the settled updates' lines, written at the next flush
        # updates added since the last settle; the same list for the writer's whole life (emptied, never replaced),
        # so the loop may hold its bound ``append``
        self.pending: list[tuple] = []
        self.seen = seen
        self.sums = self._zero()
        self.last_loss = float("nan")
        mode = "r+b" if self.path.exists() else "w+b"
        self.handle = open(self.path, mode)
        if offset is not None:
            self.handle.truncate(offset)
        self.handle.seek(0, os.SEEK_END)

    def add(self, update: int, charge: float, used: float, wall: float, loss, ids) -> None:
        """One update's line, kept as the tuple ``(update, charge, used, wall, loss, ids)``, flushed every
        ``FLUSH_LINES``. ``loss`` is a number, or a scalar tensor read later with the others: only a detached one
        may be kept, since holding the loss itself would keep its autograd graph alive until the flush, moving the
        graph's teardown, a part of the update's cost, out of the timed interval. ``ids`` must not change until the
        flush: a copy of the batch's row ids, unless the sampler hands over a new array with each batch.

        The run's loop appends the same tuple to ``pending`` itself and checks the length, without this call:
        there, a call costs more than its work (see the module docstring)."""
        self.pending.append((update, charge, used, wall, loss, ids))
        if len(self.pending) >= FLUSH_LINES:
            self.flush(durable=False)

    @staticmethod
    def _zero() -> dict[str, float]:
        return {"train_wall": 0.0, "train_cpu": 0.0, "examples": 0, "nonfinite_losses": 0}

    def take_sums(self) -> dict[str, float]:
        """Settle, and hand over the sums of the updates settled since the last call."""
        self.settle()
        sums, self.sums = self.sums, self._zero()
        return sums

    def settle(self) -> None:
        """Read the kept losses (one transfer), compute the digests and format the line of every update added
        since the last call."""
        if not self.pending:
            return
        pending = self.pending
        losses = read_floats([line[4] for line in pending])
        seen = self.seen
        sha256 = hashlib.sha256
        asarray = np.asarray
        lines = self.lines
        wall_sum = 0.0
        id_bytes = nonfinite = 0
        for (update, charge, used, wall, _, ids), loss in zip(pending, losses):
            ids = asarray(ids, dtype=_INT64).tobytes()  # the digests are of int64 bytes, whatever the sampler gave
            rows = sha256(ids).hexdigest()[:16]
            seen = sha256(f"{seen}:{rows}".encode()).hexdigest()[:32]
            wall_sum += wall
            id_bytes += len(ids)
            # the clock figures are finite by construction (the meter refuses others); only the loss may not be
            if loss - loss == 0.0:
                lines.append(f'{{"charge":{charge!r},"cpu":{repr(charge) if self.cpu_charges else "null"},'
                             f'"loss":{loss!r},"rows":"{rows}","seen":"{seen}","update":{update},"used":{used!r},'
                             f'"wall":{wall!r}}}')
            else:
                nonfinite += 1
                lines.append(json.dumps({"charge": charge, "cpu": charge if self.cpu_charges else None, "loss": loss,
                                         "rows": rows, "seen": seen, "update": update, "used": used, "wall": wall},
                                        separators=(",", ":"), allow_nan=True, sort_keys=True))
        self.seen = seen
        sums = self.sums
        sums["train_wall"] += wall_sum
        if self.cpu_charges:
            sums["train_cpu"] += sum(line[1] for line in pending)
        sums["examples"] += id_bytes // 8
        sums["nonfinite_losses"] += nonfinite
        self.last_loss = losses[-1]
        pending.clear()

    def flush(self, durable: bool = True) -> int:
        """Settle, then write the buffered lines as one gzip member; returns the file's complete length.

        Only a flush whose offset a checkpoint records needs to reach the disk (``durable``): after a crash the
        file is cut back to that offset anyway, so the periodic flushes in between skip the fsync.
        """
        self.settle()
        if self.lines:
            data = ("\n".join(self.lines) + "\n").encode()
            self.handle.write(gzip.compress(data, compresslevel=1, mtime=0))
            self.lines = []
            self.handle.flush()
        if durable:
            os.fsync(self.handle.fileno())
        return self.handle.tell()

    def close(self) -> None:
        self.flush()
        self.handle.close()


def read_steps(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete line of a steps file; a member cut short by a crash is ignored."""
    data = Path(path).read_bytes()
    position = 0
    while position < len(data):
        decompressor = zlib.decompressobj(wbits=31)
        try:
            text = decompressor.decompress(data[position:])
        except zlib.error:
            return
        if not decompressor.eof:
            return
        for line in text.decode().splitlines():
            if line:
                yield json.loads(line)
        position = len(data) - len(decompressor.unused_data)
