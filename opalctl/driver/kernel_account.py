"""The training process as the kernel counts it, read from outside by the evaluator.

Every figure the training process reports of itself is its own account, and once an agent's program has run in it
that account may say anything: a program could train the model in ``build()`` or in a thread of its own and leave
the budget meter as it was. What the kernel counted cannot be rewritten from inside: the CPU seconds of every
thread of the process (``/proc/PID/stat``'s utime and stime; children only once the process waited for them, and
a confined agent arm's training process can start none) and its peak resident memory (``VmHWM``). The evaluator
is a child of the training process, started before any agent code, and reads its parent's figures at each message;
stage records and ``report.json`` carry them, so ``compare`` can set an arm's training process against the
baseline's at equal budget.

Where ``/proc`` cannot be read (macOS) every figure is None.
"""

from __future__ import annotations

import os
from pathlib import Path


class KernelAccount:
    """One process's CPU seconds and peak memory, as ``/proc`` has them."""

    def __init__(self, pid: int, proc: Path = Path("/proc")):
        self.folder = proc / str(pid)
        try:
            self.ticks = os.sysconf("SC_CLK_TCK")
        except (ValueError, OSError, AttributeError):
            self.ticks = 100

    def cpu_seconds(self) -> float | None:
        """User and system CPU seconds of every thread of the process so far (None where unreadable)."""
        try:
            fields = (self.folder / "stat").read_text().rpartition(")")[2].split()
            return (int(fields[11]) + int(fields[12])) / self.ticks  # utime, stime (fields 14 and 15 of stat)
        except (OSError, ValueError, IndexError):
            return None

    def peak_rss_bytes(self) -> int | None:
        try:
            for line in (self.folder / "status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None


class SessionCpu:
    """The CPU the kernel counted for a run's training processes: what earlier sessions left at the last stage they
    reached (``carried``) plus this session's since its start (its process began before the mark, and what it spent
    importing and building before the mark is not counted, the same for every arm)."""

    def __init__(self, account: KernelAccount):
        self.account = account
        self.mark = account.cpu_seconds()
        self.carried = 0.0

    def total(self) -> float | None:
        now = self.account.cpu_seconds()
        if now is None or self.mark is None:
            return None
        return round(self.carried + now - self.mark, 3)
