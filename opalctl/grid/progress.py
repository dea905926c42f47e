"""How far a running run is, read from its folder while it trains: no message from the child is needed.

``start.json`` gives the budget's total, and the last complete line of ``steps.jsonl.gz`` the budget used so far
and the update. The steps file is a sequence of complete gzip members written every few hundred updates and at
every checkpoint (driver/records.py), so it is read incrementally: only the bytes added since the last look are
decompressed, a member cut short is simply waited for, and a file that got shorter (a resume cut it back to its
last checkpoint) is read again from the start. Reading the folder rather than the child's output is the sturdier
choice: it works the same for a child on this machine and for a Slurm job on another node of a shared file
system, and it survives the grid itself being restarted.
"""

from __future__ import annotations

import json
import time
import zlib
from collections import deque
from pathlib import Path

from opalctl.files import open_plain, read_plain
from opalctl.formats import RECORD_MAX_BYTES
from opalctl.layout import RunLayout


class StepsTail:
    """The last complete line of a growing ``steps.jsonl.gz``, decompressing only what was added; with ``keep``,
    also the last ``keep`` lines in order (``recent``: a watcher's loss curve)."""

    def __init__(self, path: Path, keep: int = 0):
        self.path = path
        self.keep = keep
        self._restart()

    def _restart(self) -> None:
        self.offset = 0
        self.inflater = zlib.decompressobj(wbits=31)
        self.partial = b""
        self.last: dict | None = None
        self.recent: deque[dict] = deque(maxlen=self.keep)

    def read(self) -> dict | None:
        try:
            with open_plain(self.path) as handle:  # never a FIFO waited on, a device or a link followed
                size = handle.seek(0, 2)
                if size < self.offset:
                    self._restart()
                handle.seek(self.offset)
                added = handle.read()
        except OSError:
            return self.last
        self.offset += len(added)
        try:
            self._feed(added)
        except zlib.error:  # not what the steps writer writes: say nothing rather than something wrong
            self._restart()
            self.offset = size
        return self.last

    def _feed(self, data: bytes) -> None:
        while data:
            text = self.inflater.decompress(data)
            self._lines(text)
            if not self.inflater.eof:
                return
            data = self.inflater.unused_data  # the next gzip member starts here
            self.inflater = zlib.decompressobj(wbits=31)

    def _lines(self, text: bytes) -> None:
        chunks = (self.partial + text).split(b"\n")
        self.partial = chunks.pop()
        if self.keep:
            self._keep(chunks[-self.keep:])
            return
        for chunk in reversed(chunks):
            if chunk.strip():
                try:
                    self.last = json.loads(chunk)
                except ValueError:
                    continue
                return


    def _keep(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            if chunk.strip():
                try:
                    self.last = json.loads(chunk)
                except ValueError:
                    continue
                self.recent.append(self.last)


class RunProgress:
    """The fraction of the budget a run has used, its update, and an estimate of the seconds left."""

    def __init__(self, run_dir: Path, clock=time.monotonic, keep: int = 0):
        self.run_dir = run_dir
        self.layout = RunLayout.of(run_dir)
        self.tail = StepsTail(self.layout.steps, keep)
        self.clock = clock
        self.total: float | None = None
        self.first: tuple[float, float] | None = None  # (time, fraction) when this session first saw progress

    def read(self) -> dict:
        """``fraction`` (or None before the first line), ``updates`` and ``eta_seconds`` (or None)."""
        if self.total is None:
            self.total = _budget_total(self.layout.start)
        line = self.tail.read()
        if line is None or not self.total:
            return {"fraction": None, "updates": None, "eta_seconds": None}
        fraction = min(1.0, float(line.get("used", 0.0)) / self.total)
        now = self.clock()
        if self.first is None:
            self.first = (now, fraction)
        return {"fraction": fraction, "updates": line.get("update"), "eta_seconds": self._eta(now, fraction)}

    def _eta(self, now: float, fraction: float) -> float | None:
        since, at = self.first
        if fraction <= at or now <= since:
            return None
        return (1.0 - fraction) * (now - since) / (fraction - at)


def _budget_total(path: Path) -> float | None:
    try:
        return float(json.loads(read_plain(path, RECORD_MAX_BYTES))["budget"]["total"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
