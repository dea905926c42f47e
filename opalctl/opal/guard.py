"""Agent code under guard: the one place where a failure of agent code becomes a result, a program call's time
limit, what happens when a program does not stop, and torch's global state around each call.

``contained`` runs agent code and hands back its failure instead of raising it: training never dies because of
agent code. Every ``BaseException`` a program raises is its failure (``SystemExit``, ``GeneratorExit`` and a
``KeyboardInterrupt`` it raised itself included). A real Ctrl-C is told apart by the signal, not by the exception
class: ``Interrupts`` is the process's SIGINT handler, which counts the signals that arrived before doing what
the handler before it did; when one arrived during the call, ``contained`` raises ``KeyboardInterrupt``, even if
the program swallowed it.

``StepGuard`` runs each program call (top level, ``build``, ``step``, ``analyze``, ``state_dict``,
``load_state_dict``) under a time limit: a SIGALRM whose handler raises ``StepTimeout`` inside the call, sent by
the process's ``Watchdog`` thread. A program that swallows it (``except BaseException: pass`` in a loop) is still
running ``HANG_GRACE`` later: the watchdog then hands the call to the guard's ``on_hang`` (which writes the
records, see ``hangs.py``), prints one sentence and ends the process with ``EXIT_PROGRAM_HUNG`` (see
``opalctl/errors.py``); ``--resume`` continues with that version marked failed.

Around each call, torch's global state (grad mode, the number of threads, the default dtype, the global random
generator) is taken and put back (``TorchState``); what a program changed is kept in ``StepGuard.changes`` for
the optimizer to record.

A failure is written without running the program's code: ``failure_text``, ``failure_message`` and ``trace_of``
read the exception's class, arguments and frames directly (``str(error)`` would call a ``__str__`` the program may
define, and the standard traceback formatter may ask its module for source lines), and ``method_call`` reads a
method of a program's object inside the guarded call.

Every call of agent code is timed (``AgentCodeTime``: wall and CPU seconds, inside the optimizer's step or
outside it; version 0, the user's optimizer or the programs given to ``wrap``, is not agent code and is not
timed): the formal run charges what ran outside timed updates to its budget (``take_outside``), and the totals are
in the agent figures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from opalctl.errors import EXIT_PROGRAM_HUNG
from opalctl.layout import version_name
from opalctl.opal.plain import plain_problem, type_name

HANG_GRACE = 1.0  # seconds past the alarm (at least; the limit itself when longer) before a call counts as hung


class StepFailure(Exception):
    """A program's step failed one of the checks; the message says which."""


class StepTimeout(BaseException):
    """Raised by the alarm inside a call that ran past its limit (a BaseException so ``except Exception`` in a
    program cannot swallow it)."""


class Interrupts:
    """The process's SIGINT handler: counts the signals that arrived, then runs the handler that was there before
    (Python's own raises KeyboardInterrupt). Installed once, from the main thread, over a handler that is a
    Python callable (an ignored SIGINT stays ignored)."""

    _shared: Interrupts | None = None

    def __init__(self) -> None:
        self.count = 0
        self.previous: Callable[..., Any] | None = None

    @classmethod
    def shared(cls) -> Interrupts:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        if current == self.handler or not callable(current):
            return
        self.previous = current
        signal.signal(signal.SIGINT, self.handler)

    def handler(self, signum, frame) -> None:
        self.count += 1
        if self.previous is not None:
            self.previous(signum, frame)


def contained(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    """Run agent code: ``(its value, None)``, or ``(None, the error)`` for any failure; a KeyboardInterrupt is
    raised only when a real SIGINT arrived during the call (the user stops training; agent code does not)."""
    interrupts = Interrupts.shared()
    before = interrupts.count
    try:
        value = fn(*args)
    except BaseException as error:  # noqa: B036 - agent code must never end training
        if interrupts.count != before:
            raise KeyboardInterrupt from None
        return None, error
    if interrupts.count != before:  # the program swallowed the user's Ctrl-C
        raise KeyboardInterrupt
    return value, None


_ARGS = BaseException.__dict__["args"]  # the exception's arguments, read without its class's code
_TRACEBACK = BaseException.__dict__["__traceback__"]


def failure_message(error: BaseException) -> str:
    """What ``str(error)`` gives for an ordinary exception, without calling any code of the exception: its
    arguments when they are plain data (a string, say), else only their types. ``str(error)`` would call the
    class's ``__str__`` (or an argument's), which a program can define to loop forever or to return a string
    subclass of its own."""
    args = _ARGS.__get__(error)
    if type(args) is not tuple or not args:
        return ""
    keyed = issubclass(type(error), KeyError)  # str(KeyError(x)) is repr(x)
    if len(args) == 1 and type(args[0]) is str and not keyed:
        return args[0]
    if plain_problem(args, tensors="none") is not None:
        kinds = ", ".join(type_name(arg) for arg in args[:3])
        return f"(its arguments, of types {kinds}, are not shown)"
    if len(args) > 1:
        return repr(args)
    return repr(args[0]) if keyed else str(args[0])


def failure_text(error: BaseException) -> str:
    """``Name: message`` of a failure, as ``f"{type(error).__name__}: {error}"`` reads for an ordinary exception,
    calling no code of the exception (``failure_message``)."""
    message = failure_message(error)
    return f"{type_name(error)}: {message}" if message else type_name(error)


def method_call(obj: Any, method: str, *args: Any) -> Any:
    """``obj.method(*args)``, for a guarded call: the attribute is read inside it too (an object of a program's may
    define ``__getattr__``)."""
    return getattr(obj, method)(*args)


def _text(value: Any) -> str:
    return value if type(value) is str else str(value) if type(value) is int else f"<{type_name(value)}>"


def trace_of(error: BaseException, limit: int) -> str:
    """The last ``-limit`` frames of ``error``'s traceback (file, line and function of each, without the source
    line) and ``failure_text``, in the layout ``traceback.format_exception`` prints. Built from the frames' code
    objects only: the standard formatter calls ``str(error)`` and may ask a program's module for its source."""
    frames = []
    tb = _TRACEBACK.__get__(error)
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append(f'  File "{_text(code.co_filename)}", line {_text(tb.tb_lineno)}, in {_text(code.co_name)}\n')
        tb = tb.tb_next
    frames = frames[limit:] if limit < 0 else frames[:limit]
    head = "Traceback (most recent call last):\n" if frames else ""
    return head + "".join(frames) + failure_text(error) + "\n"


RNG_COMPARED_EVERY = 64  # after the first ones, every 64th call compares the generator's state (see TorchState)


class TorchState:
    """Torch's global state a program could change, taken before a call and put back after it (``put_back``,
    which names what had changed). The global generator is put back after every call; whether a program drew
    from it is compared (two copies of its 5 kB state to bytes, most of the cost of this class) on the calls
    ``compare_rng`` says, so a program that draws on each call is found at its first, and the ordinary call costs
    one copy of the state and one ``set_state`` (about 1 us, against 0.7 us for the rest of a guarded call)."""

    __slots__ = ("grad", "threads", "dtype", "rng", "compare_rng")

    def __init__(self, compare_rng: bool = True) -> None:
        self.grad = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.rng = torch.default_generator.get_state()
        self.compare_rng = compare_rng

    def put_back(self) -> list[str]:
        changed = []
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
            changed.append("grad mode")
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
            changed.append("number of threads")
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
            changed.append("default dtype")
        generator = torch.default_generator
        if self.compare_rng and generator.get_state().numpy().tobytes() != self.rng.numpy().tobytes():
            changed.append("global random generator")
        generator.set_state(self.rng)
        return changed


class Watchdog:
    """The process's SIGALRM handler and the thread that sends it. ``seq`` numbers the armed calls; ``fire`` is
    the call the thread signalled, so that a signal that arrives after that call ended (or in the next one) is
    ignored; ``current`` is (the guard, the version, the call's name) of the armed call. One call runs at a
    time, in the main thread."""

    _shared: Watchdog | None = None

    def __init__(self) -> None:
        self.armed = False
        self.seq = 0
        self.fire = -1
        self.started = 0.0
        self.limit = 0.0
        self.current: tuple[Any, Any, str] | None = None
        self.thread: threading.Thread | None = None

    @classmethod
    def shared(cls) -> Watchdog:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def handler(self, signum, frame) -> None:
        if self.armed and self.fire == self.seq:
            raise StepTimeout("the call ran past its time limit")

    def start(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._watch, args=(threading.main_thread().ident,),
                                           name="opal-step-watchdog", daemon=True)
            self.thread.start()

    def _watch(self, main_thread: int) -> None:
        """Looks at the armed call every quarter of its limit (so a call over its limit is stopped within 1.25
        times it), signals the main thread when it is over, and ends the process when it is still running
        ``HANG_GRACE`` later. A thread rather than ``setitimer``: two system calls per step would cost more than
        the step of a small model can spare; sleeping costs nothing."""
        while True:
            time.sleep(max((self.limit or 1.0) / 4, 0.005))
            seq, current = self.seq, self.current
            if not self.armed or current is None:
                continue
            over = time.perf_counter() - self.started - self.limit
            guard = current[0]
            if over > 0 and self.fire != seq and guard.active:
                self.fire = seq
                signal.pthread_kill(main_thread, signal.SIGALRM)
            elif over > max(self.limit, HANG_GRACE) and self.armed and self.seq == seq:
                guard.hung(current[1], current[2])


def is_agent_code(version: Any) -> bool:
    """Whether ``version``'s calls are agent code: every version but 0, which is the user's own optimizer (the
    released starting program) or the programs the caller handed to ``wrap``, never the agent's."""
    return version is not None and version.number != 0


class AgentCodeTime:
    """The seconds agent code ran in this process, wall and CPU (``time.process_time``, which counts every thread of
    the process), split by where: inside a timed update (the optimizer's ``step``, which a formal run times with the
    update: a program's step and its analysis) or outside one (a decision's top levels and ``build()``, a
    checkpoint's ``state_dict()``, a resume's top levels and ``load_state_dict()``). What ran outside since the last
    ``take_outside`` is kept apart, for the formal run to charge to its budget: work a program does outside the
    timed updates (training its model in ``build()``, say) is never free."""

    __slots__ = ("inside_cpu", "inside_wall", "outside_cpu", "outside_wall", "untaken_cpu", "untaken_wall")

    def __init__(self) -> None:
        self.inside_cpu = self.inside_wall = self.outside_cpu = self.outside_wall = 0.0
        self.untaken_cpu = self.untaken_wall = 0.0

    def add(self, inside: bool, cpu: float, wall: float) -> None:
        if inside:
            self.inside_cpu += cpu
            self.inside_wall += wall
        else:
            self.outside_cpu += cpu
            self.outside_wall += wall
            self.untaken_cpu += cpu
            self.untaken_wall += wall

    def take_outside(self) -> tuple[float, float]:
        """``(cpu seconds, wall seconds)`` of agent code run outside timed updates since the last take."""
        taken = (self.untaken_cpu, self.untaken_wall)
        self.untaken_cpu = self.untaken_wall = 0.0
        return taken

    def figures(self) -> dict[str, dict[str, float]]:
        """The totals, as ``AgentFigures.agent_code_seconds`` holds them."""
        return {"inside_updates": {"cpu": self.inside_cpu, "wall": self.inside_wall},
                "outside_updates": {"cpu": self.outside_cpu, "wall": self.outside_wall}}

    def state_dict(self) -> dict[str, dict[str, float]]:
        return self.figures()

    def load_state_dict(self, state: dict[str, dict[str, float]] | None) -> None:
        """Add the totals of the sessions before this one (None: a state saved before they were carried). What
        this session ran before the load (the programs installed again at a resume) stays counted, and untaken."""
        if state is None:
            return
        inside, outside = state["inside_updates"], state["outside_updates"]
        self.inside_cpu += float(inside["cpu"])
        self.inside_wall += float(inside["wall"])
        self.outside_cpu += float(outside["cpu"])
        self.outside_wall += float(outside["wall"])


class StepGuard:
    """One optimizer's program calls under their time limit, and the checks of its parameters after a step. The
    alarm is ``active`` when it could be set (only from the main thread, and only when the program has no
    SIGALRM handler of its own); otherwise a step over its limit is still caught, after it returns
    (``enforce``), and a call that never returns still ends the process. ``on_hang(version, call, limit)`` writes
    the records of a hang. Every call of agent code is timed into ``time`` (``AgentCodeTime``), inside an update
    while ``in_update`` is set (by the optimizer, through ``timing_update()``, while its ``step`` runs)."""

    def __init__(self, limit: float, named: dict[str, Any], on_hang: Callable[[Any, str, float], str] | None = None):
        self.limit = limit
        self.named = named
        self.layout = {name: (p.dtype, p.device, tuple(p.shape)) for name, p in named.items()}
        self.on_hang = on_hang
        self.steps = 0  # steps run under this guard (the global generator is compared on some, see TorchState)
        self.changes: list[tuple[Any, str, list[str]]] = []  # (version, call, what it changed), for the records
        self.time = AgentCodeTime()
        self.in_update = False
        self._watchdog = Watchdog.shared()
        self.active = self._install()
        if self.limit:
            self._watchdog.start()

    def take_changes(self) -> list[tuple[Any, str, list[str]]]:
        """The changes to torch's global state put back since the last take, ``(version, call, what)`` each."""
        changes, self.changes = self.changes, []
        return changes

    def _install(self) -> bool:
        if not self.limit or threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGALRM)
        if previous not in (signal.SIG_DFL, signal.SIG_IGN, None, self._watchdog.handler):
            return False  # the program has its own alarm handler: leave it alone
        signal.signal(signal.SIGALRM, self._watchdog.handler)
        return True

    def _arm(self, version: Any, call: str) -> None:
        # The watchdog thread reads seq, then the call's start and limit: they are written before seq, so a thread
        # that sees this call's seq sees this call's start and limit too.
        watchdog = self._watchdog
        watchdog.armed = False
        watchdog.started, watchdog.limit = time.perf_counter(), self.limit
        watchdog.current = (self, version, call)
        watchdog.seq += 1
        watchdog.armed = bool(self.limit)

    @contextlib.contextmanager
    def timing_update(self) -> Iterator[None]:
        """Agent code run inside is timed as part of an update (``AgentCodeTime``)."""
        self.in_update = True
        try:
            yield
        finally:
            self.in_update = False

    def run(self, version: Any, fn: Callable[..., Any], *args: Any) -> float:
        """``version``'s step, ``fn(*args)``, under the time limit, torch's global state put back after it; returns
        its duration in seconds (arming is a few attribute writes: the watchdog thread does the timing)."""
        charged = is_agent_code(version)
        started = time.perf_counter()
        cpu = time.process_time() if charged else 0.0
        steps = self.steps = self.steps + 1
        saved = TorchState(compare_rng=steps < RNG_COMPARED_EVERY or steps % RNG_COMPARED_EVERY == 0)
        self._arm(version, "step()")  # just before the try: nothing between them can leave the watchdog armed
        try:
            fn(*args)
        finally:
            self._watchdog.armed = False
            changed = saved.put_back()
            if changed:
                self.changes.append((version, "step()", changed))
            elapsed = time.perf_counter() - started
            if charged:
                self.time.add(self.in_update, time.process_time() - cpu, elapsed)
        return elapsed

    def call(self, version: Any, call: str, fn: Callable[..., Any], *args: Any,
             charged: bool = True) -> tuple[Any, BaseException | None]:
        """Any other program call (``call`` names it: "build()", "analyze()", ...) under the same limit, through
        ``contained``: ``(its value, None)`` or ``(None, its failure)``. ``charged=False``: a call of the user's
        own code made on ``version``'s behalf (its hang is still ``version``'s), not timed as agent code."""
        charged = charged and is_agent_code(version)
        started = time.perf_counter()
        cpu = time.process_time() if charged else 0.0
        saved = TorchState()
        self._arm(version, call)
        try:
            value, error = contained(fn, *args)
        except StepTimeout as late:  # the alarm arrived between the call's end and the disarming
            value, error = None, late
        finally:
            self._watchdog.armed = False
            changed = saved.put_back()
            if changed:
                self.changes.append((version, call, changed))
        elapsed = time.perf_counter() - started
        if charged:
            self.time.add(self.in_update, time.process_time() - cpu, elapsed)
        if error is None and self.limit and elapsed > self.limit:
            error = StepTimeout(f"{call} ran past its time limit of {self.limit:g} s")
        return value, error

    def hung(self, version: Any, call: str) -> None:
        """The armed call ran past its limit and did not stop: write its records, say what happened and how to
        go on, and end the process (from the watchdog thread; the main thread is stuck in the program)."""
        try:
            sentence = self.on_hang(version, call, self.limit) if self.on_hang is not None else None
        except BaseException as error:  # noqa: B036 - the process ends whatever the records did
            sentence = f"(its records could not be written: {failure_text(error)})"
        number = getattr(version, "number", None)
        label = version_name(number) if isinstance(number, int) else "the starting program"
        sys.stderr.write(f"opal: the agent's program {label} hung in {call}: it ran past its time limit of "
                         f"{self.limit:g} s and did not stop when interrupted; {sentence or 'resume the run'} "
                         f"(exit code {EXIT_PROGRAM_HUNG})\n")
        sys.stderr.flush()
        os._exit(EXIT_PROGRAM_HUNG)

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
