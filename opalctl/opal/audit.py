"""The per-update audit: how many operator calls one update makes, and on CUDA how many host
synchronisations, so that a program that is slow because of how it is written can be told so.

``count_step(fn)`` runs ``fn()`` exactly once under ``torch.profiler.profile`` (CPU activity; CUDA activity too when
CUDA is available) and returns ``{"ops": int, "syncs": int | None, "top": [(name, count), ...]}``.

- **Operators.** An event is an operator call when the dispatcher recorded it (``RecordScope.FUNCTION``, scope 0)
  and its name is a namespaced operator (``ns::name``: ``aten::add_``, a custom ``mylib::op``). Profiler scopes
  (``Optimizer.step#AdamW.step``, ``record_function`` blocks), autograd nodes and CUDA runtime calls
  (``cudaLaunchKernel``) are not operators. An operator call is *outermost* when none of its ancestors in the
  profiler's CPU tree (``cpu_parent``, on its own thread) is an operator call: ``x.to(torch.float64)`` is one call
  (``aten::to``), not four (``aten::to``, ``aten::_to_copy``, ``aten::empty_strided``, ``aten::copy_``), while an
  ``aten::mul_`` directly under the ``Optimizer.step`` scope is outermost. The count is what the program asked for,
  one per Python-level tensor operation, whatever the kernels do underneath.
- **Host synchronisations** (CUDA only; ``None`` when CUDA is not available). Two independent counts, the larger
  is reported: (1) ``torch.cuda.set_sync_debug_mode("warn")`` for the duration of ``fn``, counting its
  "called a synchronizing CUDA operation" warnings (``.item()``, ``.cpu()``, ``.tolist()``, ``nonzero``, a blocking
  copy, ``Stream.synchronize`` ...); (2) the CUDA runtime calls that block the host, as the profiler saw them
  (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``, ``cudaEventSynchronize``, blocking ``cudaMemcpy``):
  these also catch ``torch.cuda.synchronize()``, which the debug mode does not report. Each synchronisation is one
  of each, so the larger count is the number of synchronisations, not their sum. Other warnings ``fn`` raises are
  re-issued after it; the previous debug mode is restored.

``fn``'s effect is unchanged: the profiler observes, it does not alter the arithmetic, and ``fn`` runs once. An
exception from ``fn`` propagates after the profiler is stopped and the debug mode restored. When a profiler is
already running (or the profiler fails to start or to stop), ``fn`` still runs exactly once, the counts are
``None`` and ``"error"`` says why.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from opalctl.opal.guard import failure_message
from opalctl.opal.plain import type_name

OPERATOR_SCOPE = 0  # RecordScope::FUNCTION: calls recorded by the dispatcher
TOP = 10
SYNC_WARNING = "called a synchronizing CUDA operation"
BUILTIN_WARNINGS = (UserWarning, DeprecationWarning, PendingDeprecationWarning, SyntaxWarning, RuntimeWarning,
                    FutureWarning, ImportWarning, UnicodeWarning, BytesWarning, ResourceWarning, EncodingWarning,
                    Warning)
MARK = "opal.audit.step"  # a record_function scope around fn (a user scope: not an operator)
SYNC_RUNTIME_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                                "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol",
                                "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2",
                                "cuMemcpyHtoD_v2"})


def _is_operator(event) -> bool:
    name = event.name
    if "::" not in name or " " in name or name.startswith("autograd::"):
        return False
    scope = getattr(event, "scope", OPERATOR_SCOPE)
    if scope != OPERATOR_SCOPE:
        return False
    device_type = getattr(event, "device_type", None)
    return device_type is None or device_type == torch.autograd.DeviceType.CPU


def outermost_operators(events) -> list[str]:
    """The names of the outermost operator calls among profiler ``events`` (a ``prof.events()`` list)."""
    names = []
    for event in events:
        if not _is_operator(event):
            continue
        parent = event.cpu_parent
        while parent is not None and not _is_operator(parent):
            parent = parent.cpu_parent
        if parent is None:
            names.append(event.name)
    return names


def _cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install is the same as none here
        return False


def _profiler_running() -> bool:
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if callable(enabled) else False


def _within_mark(events) -> list:
    """The events inside ``fn``'s marker scope (by time, on any thread): leaves out what the profiler itself does
    when it stops (it synchronises the device first). All events when the marker is missing."""
    marks = [event for event in events if event.name == MARK]
    if not marks:
        return list(events)
    start = min(mark.time_range.start for mark in marks)
    end = max(mark.time_range.end for mark in marks)
    return [event for event in events
            if event.name != MARK and start <= event.time_range.start and event.time_range.end <= end]


@contextlib.contextmanager
def _native_stderr_quiet():
    """Silence file descriptor 2 while the profiler starts or stops: torch's native tracer may print a status line
    there ("USDT: ... profiler_start") that says nothing to a user. Only this call is covered; Python's own
    ``sys.stderr`` is flushed first, and the descriptor is always restored."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _start_profiler(cuda: bool):
    """A started profiler (CPU and, on CUDA, CUDA activities; the CPU alone when CUPTI cannot start), or None."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for attempt in (activities, [ProfilerActivity.CPU]):
        try:
            profiler = profile(activities=attempt)
            with _native_stderr_quiet():  # some torch builds print a line on stderr when the profiler starts
                profiler.__enter__()
            return profiler
        except Exception:  # noqa: BLE001 - CUPTI unavailable, say: try the CPU profiler alone
            if attempt == [ProfilerActivity.CPU]:
                return None
    return None


def _run_marked(fn: Callable[[], Any], cuda: bool) -> tuple[list[warnings.WarningMessage], BaseException | None]:
    """Run ``fn()`` inside the mark, with CUDA's sync debug mode on warn; returns the warnings caught and the
    failure (re-raised by the caller once the profiler is stopped)."""
    previous_mode = None
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                previous_mode = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.profiler.record_function(MARK):
                    fn()
            finally:
                if cuda and previous_mode is not None:
                    torch.cuda.set_sync_debug_mode(previous_mode)
    except BaseException as error:  # noqa: B036 - stop the profiler first, then re-raise it unchanged
        return caught, error
    return caught, None


def _sync_warnings(caught: list[warnings.WarningMessage]) -> int:
    """How many of the warnings were CUDA's sync warnings; the others are warned again (not ours to swallow). The
    program's step made them, and a warning of its own could run its code when shown: each is read as text without
    calling it (``failure_message``) and warned again as that text, under its category when that is a built-in one."""
    count = 0
    for message in caught:
        warning = message.message
        text = failure_message(warning) if issubclass(type(warning), BaseException) else ""
        if SYNC_WARNING in text:
            count += 1
        else:
            category = next((known for known in BUILTIN_WARNINGS if message.category is known), UserWarning)
            filename = message.filename if type(message.filename) is str else "<unknown>"
            lineno = message.lineno if type(message.lineno) is int else 0
            warnings.warn_explicit(text or type_name(warning), category, filename, lineno)
    return count


def count_step(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn()`` once and count its outermost operator calls (and, on CUDA, its host synchronisations)."""
    cuda = _cuda_available()
    if _profiler_running():
        fn()
        return {"ops": None, "syncs": None, "top": [], "error": "a profiler is already running"}
    profiler = _start_profiler(cuda)
    if profiler is None:
        fn()
        return {"ops": None, "syncs": None, "top": [], "error": "the profiler could not start"}
    caught, failure = _run_marked(fn, cuda)
    stop_error = None
    try:
        with _native_stderr_quiet():
            profiler.__exit__(None, None, None)
        events = profiler.events()
    except Exception as error:  # noqa: BLE001 - the counts are lost, not the update
        stop_error, events = f"the profiler failed: {type(error).__name__}: {error}", None
    sync_warnings = _sync_warnings(caught)
    if failure is not None:
        raise failure
    if events is None:
        return {"ops": None, "syncs": sync_warnings if cuda else None, "top": [], "error": stop_error}
    events = _within_mark(events)
    names = outermost_operators(events)
    counts = collections.Counter(names)
    top = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:TOP]
    syncs = None
    if cuda:
        runtime = sum(1 for event in events if event.name in SYNC_RUNTIME_CALLS)
        syncs = max(sync_warnings, runtime)
    return {"ops": len(names), "syncs": syncs, "top": [(name, count) for name, count in top]}


__all__ = ["count_step", "outermost_operators", "SYNC_RUNTIME_CALLS"]
