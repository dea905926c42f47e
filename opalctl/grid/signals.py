"""The grid's own signals: Ctrl-C (SIGINT), SIGTERM and SIGHUP ask the grid to stop, they do not kill it.

The grid's children run in sessions of their own, so a Ctrl-C at the terminal reaches the grid alone; the grid
then stops every child itself with SIGTERM (never SIGKILL first), which leaves each run resumable, waits for
them, and says how to go on. Handlers can only be installed from the main thread; elsewhere (a caller's worker
thread) the grid relies on KeyboardInterrupt, which the executors treat the same way.
"""

from __future__ import annotations

import signal
import threading

STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequest:
    """Whether, and by which signal, the grid was asked to stop; a context manager that installs the handlers."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def request(self, signum: int = signal.SIGINT) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in STOPPING_SIGNALS:
                self._previous[signum] = signal.signal(signum, lambda number, frame: self.request(number))
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        """The grid's exit code when it was stopped: 128 + the signal, as the runs' own."""
        return 128 + (self.signum or signal.SIGINT)
