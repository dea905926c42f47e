"""Ending a process of opalctl's own without the interpreter's teardown, where torch is imported.

Once torch is imported, the interpreter's teardown (clearing every module, collecting what is left) takes most of
a second of CPU (0.6 to 0.8 s on the hosts the tests run on), after the process's work is done and while whoever
started it waits: every ``opalctl run`` (a grid's runs, each rank under torchrun) and every run's evaluator. What
a normal exit does that matters still happens here: the ``atexit`` handlers run (``weakref.finalize``'s among
them), and every file object still open is flushed (a task's log it never closed keeps its tail), standard output
and error among them. Skipped: the rest of the finalisation of objects still alive, which is why a process with a
thread of its own still running (not a daemon) exits the usual way, and so does one without torch, whose teardown
is quick.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading


def end_without_teardown(code: int | str | None) -> None:
    """Exit now with ``code`` as ``sys.exit(code)`` would (a text is printed and exits 1), skipping the
    interpreter's teardown; returns without doing anything where the usual exit is needed (the module docstring)."""
    if "torch" not in sys.modules:
        return
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    if code is not None and not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
    for stream in _open_files():
        try:
            stream.flush()
        except (OSError, ValueError):  # closed meanwhile, or the reader is gone
            pass
    os._exit(0 if code is None else code if isinstance(code, int) else 1)


def _open_files() -> list:
    """Every buffered file object still open, standard output and error last (what the teardown would flush; 0.07 s
    to find among a torch process's objects)."""
    found = [obj for obj in gc.get_objects()
             if type(obj) in (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom) and not obj.closed
             and obj not in (sys.stdout, sys.stderr)]
    return [*found, sys.stdout, sys.stderr]
