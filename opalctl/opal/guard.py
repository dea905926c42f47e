"""Agent code under guard: the one place where a failure of agent code becomes a result, and a step's time limit.

``contained`` runs agent code (a program's ``build``, ``step`` or ``analyze``) and hands back its failure instead
of raising it: training never dies because of agent code. The rule of what is *not* contained (a KeyboardInterrupt,
a real Ctrl-C) is written there and nowhere else, so that changing it is changing one line.

``StepGuard`` is the time limit of one optimizer's steps. The limit is a SIGALRM whose handler raises inside the
step, sent by a watchdog thread. A process has one SIGALRM handler, so the handler and its thread are one
``Watchdog`` per process (``Watchdog.shared()``); each guard arms it around its own steps.
"""

from __future__ import annotations

import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


class StepFailure(Exception):
    """A program's step failed one of the checks; the message says which."""


class StepTimeout(BaseException):
    """Raised by the alarm inside a step that ran past its limit (a BaseException so ``except Exception`` in a
    program cannot swallow it)."""


def contained(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """Run agent code: ``(its value, None)``, or ``(None, the error)`` for any failure but a KeyboardInterrupt,
    which is raised (the user stops training; agent code does not)."""
    try:
        return fn(*args), None
    except BaseException as error:  # noqa: B036 - agent code must never end training
        if isinstance(error, KeyboardInterrupt):
            raise
        return None, error


def trace_of(error: BaseException, limit: int) -> str:
    """The last ``-limit`` frames of ``error``'s traceback, as ``traceback.format_exc`` would print them."""
    return "".join(traceback.format_exception(error, limit=limit))


class Watchdog:
    """The process's SIGALRM handler and the thread that sends it. ``seq`` numbers the armed steps; ``fire`` is
    the step the thread signalled, so that a signal that arrives after that step ended (or in the next one) is
    ignored. One step runs at a time, in the main thread."""

    _shared: Watchdog | None = None

    def __init__(self) -> None:
        self.armed = False
        self.seq = 0
        self.fire = -1
        self.started = 0.0
        self.limit = 0.0
        self.thread: threading.Thread | None = None

    @classmethod
    def shared(cls) -> Watchdog:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def handler(self, signum, frame) -> None:
        if self.armed and self.fire == self.seq:
            self.armed = False
            raise StepTimeout("the step ran past its time limit")

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._watch, args=(threading.main_thread().ident,),
                                           name="opal-step-watchdog", daemon=True)
            self.thread.start()

    def _watch(self, main_thread: int) -> None:
        """Looks at the armed step every quarter of its limit (so a step over its limit is stopped within 1.25
        times it) and signals the main thread when it is over. A thread rather than ``setitimer``: two system
        calls per step would cost more than the step of a small model can spare; sleeping costs nothing."""
        while True:
            time.sleep(max((self.limit or 1.0) / 4, 0.005))
            seq = self.seq
            if self.armed and time.perf_counter() - self.started > self.limit and self.seq == seq:
                self.fire = seq
                signal.pthread_kill(main_thread, signal.SIGALRM)


class StepGuard:
    """One optimizer's step time limit, and the checks of its parameters after a step. The limit is ``active``
    when the alarm could be set (only from the main thread, and only when the program has no SIGALRM handler of
    its own); otherwise a step over its limit is still caught, after it returns (``enforce``)."""

    def __init__(self, limit: float, named: dict[str, Any]):
        self.limit = limit
        self.named = named
        self.layout = {name: (p.dtype, p.device, tuple(p.shape)) for name, p in named.items()}
        self._watchdog = Watchdog.shared()
        self.active = self._install()

    def _install(self) -> bool:
        if not self.limit or threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGALRM)
        if previous not in (signal.SIG_DFL, signal.SIG_IGN, None, self._watchdog.handler):
            return False  # the program has its own alarm handler: leave it alone
        signal.signal(signal.SIGALRM, self._watchdog.handler)
        self._watchdog.start()
        return True

    def run(self, fn: Callable[..., Any], *args: Any) -> float:
        """``fn(*args)`` under the alarm; returns its duration in seconds (arming is a few attribute writes: the
        watchdog thread does the timing)."""
        started = time.perf_counter()
        if not self.active:
            fn(*args)
            return time.perf_counter() - started
        watchdog = self._watchdog
        watchdog.seq += 1
        watchdog.started, watchdog.limit = started, self.limit
        watchdog.armed = True
        try:
            fn(*args)
        finally:
            watchdog.armed = False
        return time.perf_counter() - started

    def enforce(self, elapsed: float) -> None:
        """Raise StepFailure for a step that returned after its limit."""
        if self.limit and elapsed > self.limit:
            raise StepFailure(f"the step took {elapsed:.2f} s, over its limit of {self.limit:.2f} s")

    def check(self, full: bool) -> str | None:
        """What is wrong with the parameters after a step (None when nothing is): a changed dtype, device or
        shape, and with ``full`` a non-finite value (one device sync)."""
        for name, p in self.named.items():
            dtype, device, shape = self.layout[name]
            if p.dtype != dtype:
                return f"parameter {name} changed dtype from {dtype} to {p.dtype}"
            if p.device != device:
                return f"parameter {name} moved from {device} to {p.device}"
            if tuple(p.shape) != shape:
                return f"parameter {name} changed shape from {shape} to {tuple(p.shape)}"
        if full:
            import torch

            flags = torch.stack([torch.isfinite(p.detach()).all() for p in self.named.values()])
            if not bool(flags.all()):
                bad = [name for name, ok in zip(self.named, flags.tolist()) if not ok]
                return f"non-finite values in {', '.join(bad[:3])}"
        return None

    def close(self) -> None:
        """Give the SIGALRM handler back (from the main thread only, where it was set)."""
        if self.active and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            self.active = False
