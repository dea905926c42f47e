"""The run's per-update record, ``steps.jsonl.gz``, written so that a crash never leaves it unreadable.

The file is a sequence of complete gzip members (the gzip format allows concatenation; ``gzip.open`` reads
them as one stream). Lines are buffered in memory and written as one member, flushed and fsynced, every
``FLUSH_LINES`` updates and at every checkpoint. A crash can therefore only cut the last member short; the
reader stops at the last complete member, and ``--resume`` truncates the file to the offset recorded in the
checkpoint it resumes from, so the file ends up holding exactly one line per update, as if nothing had happened.

Each line carries the update's clock figures, its loss, a digest of the batch's row ids and a running digest of
every row seen so far (so two runs that saw the same rows in the same order end with the same digest).
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

FLUSH_LINES = 512
_INF = float("inf")


_INT64 = np.dtype(np.int64)


def ids_digest(ids) -> str:
    """The batch's row ids as int64 bytes, hashed (the fast path takes the sampler's own array as it is)."""
    if getattr(ids, "dtype", None) is not _INT64:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
    try:
        return hashlib.sha256(ids).hexdigest()[:16]
    except (BufferError, ValueError):  # not contiguous
        return hashlib.sha256(np.ascontiguousarray(ids)).hexdigest()[:16]


def chain_digest(previous: str, batch_digest: str) -> str:
    return hashlib.sha256(f"{previous}:{batch_digest}".encode()).hexdigest()[:32]


class StepsWriter:
    def __init__(self, path: Path, offset: int | None = None):
        self.path = Path(path)
        self.lines: list[str] = []
        mode = "r+b" if self.path.exists() else "w+b"
        self.handle = open(self.path, mode)
        if offset is not None:
            self.handle.truncate(offset)
        self.handle.seek(0, os.SEEK_END)

    def write(self, record: dict[str, Any]) -> None:
        self.lines.append(json.dumps(record, separators=(",", ":"), allow_nan=True))
        if len(self.lines) >= FLUSH_LINES:
            self.flush(durable=False)

    def write_update(self, update: int, charge: float, used: float, cpu: float | None, wall: float, loss: float,
                     rows: str, seen: str) -> None:
        """The per-update line, kept as a tuple until it is written (formatting is the dearest part of a record,
        and here it happens once per flush, not inside the loop body's hot path)."""
        self.lines.append((update, charge, used, cpu, wall, loss, rows, seen))
        if len(self.lines) >= FLUSH_LINES:
            self.flush(durable=False)

    @staticmethod
    def _format(line) -> str:
        if isinstance(line, str):
            return line
        update, charge, used, cpu, wall, loss, rows, seen = line
        numbers = [charge, used, wall, loss] + ([] if cpu is None else [cpu])
        if all(x == x and x not in (_INF, -_INF) for x in numbers):
            return (f'{{"charge":{charge!r},"cpu":{"null" if cpu is None else repr(cpu)},"loss":{loss!r},'
                    f'"rows":"{rows}","seen":"{seen}","update":{update},"used":{used!r},"wall":{wall!r}}}')
        return json.dumps({"charge": charge, "cpu": cpu, "loss": loss, "rows": rows, "seen": seen, "update": update,
                           "used": used, "wall": wall}, separators=(",", ":"), allow_nan=True, sort_keys=True)

    def flush(self, durable: bool = True) -> int:
        """Write the buffered lines as one gzip member; returns the file's complete length.

        Only a flush whose offset a checkpoint records needs to reach the disk (``durable``): after a crash the
        file is cut back to that offset anyway, so the periodic flushes in between skip the fsync.
        """
        if self.lines:
            data = ("\n".join(self._format(line) for line in self.lines) + "\n").encode()
            self.handle.write(gzip.compress(data, compresslevel=1, mtime=0))
            self.lines = []
            self.handle.flush()
            if durable:
                os.fsync(self.handle.fileno())
        elif durable:
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
