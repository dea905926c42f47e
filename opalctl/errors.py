"""Errors that reach the user as one sentence and an exit code.

The CLI turns each of these into a message on stderr and the documented exit code, never a traceback: the
sentence, then each of ``details`` (if any) on an indented line under it. Anything else that escapes is a bug in
opalctl and is shown as such (exit 1, with the traceback kept for the report).

The exit codes: 0 done; 1 a failure while working (``OpalctlError``) or a bug; 2 bad input (``BadInput``); 3 a
frozen input changed (``InputChanged``); 4 an agent's program hung (``EXIT_PROGRAM_HUNG``): a program call ran past
its time limit and did not stop when interrupted, so the watchdog recorded it (an event and ``training/opal/hung.jsonl``
naming the version and the call) and ended the process; ``opalctl run ... --resume`` continues from the last
resume checkpoint with that version marked failed (it never runs again); 5 a run that finished (its folder
complete, it verifies) but whose agent never answered (``EXIT_AGENT_NEVER_ANSWERED``: every decision failed or
timed out, so the run is its base optimizer's alone; compare/decisions.py), and a grid with such a run; 129, 130
and 143 a run stopped by SIGHUP, SIGINT (Ctrl-C) or SIGTERM (``Interrupted``, 128 plus the signal's number): the run stops once the update in
progress ends, with a resume checkpoint there (or, past a bound, where it is, saying how many updates the resume
trains again: driver/run.py ``StopSignals``), keeps what it wrote and prints the command that continues it,
``opalctl run LOCK --arm A --seed S --resume``.

A full disk, a used-up quota, a folder that cannot be written or a file where a folder must be is a
``StorageFault`` (exit 1), raised by ``opalctl.files.storage``: its sentence names the file being written and says
that freeing space (or making the folder writable, or moving the file away) and then ``opalctl run ... --resume``
continues; a run replaces that placeholder with its own command (``StorageFault.for_command``), and a command that
is not a run (init, freeze, report, export, show --html) says to run it again (``storage``'s ``then``).
"""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_CHANGED = 3
EXIT_PROGRAM_HUNG = 4  # ended by the agent optimizer's watchdog, see the docstring
EXIT_AGENT_NEVER_ANSWERED = 5  # a finished run whose agent never answered, see the docstring
EXIT_SIGNALLED = 128  # plus the signal's number: 129 SIGHUP, 130 SIGINT, 143 SIGTERM


class OpalctlError(Exception):
    """A failure while working: something that should have worked did not (exit 1).

    ``message`` is one sentence naming the file or key and saying what to do; ``details`` are further lines, each
    complete without the others (never a repetition of the sentence)."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, details: list[str] | None = None):
        super().__init__(message)
        self.message = message
        self.details = list(details or [])


class BadInput(OpalctlError):
    """The user gave something we refuse: an invalid protocol, a bad flag, a refused path (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class InputChanged(OpalctlError):
    """A frozen input no longer matches its lock (exit 3)."""

    exit_code = EXIT_CHANGED


class StorageFault(OpalctlError):
    """A write the storage refused: the disk is full, the quota used up, the folder read-only (exit 1).

    Its sentence ends with ``CONTINUE``, which a caller that knows the exact command replaces (``for_command``);
    the message alone carries it, so the fault keeps its words across a process boundary (the evaluator's)."""

    CONTINUE = "`opalctl run ... --resume` continues"
    then: str | None = None  # the way on its sentence ends with, where files.storage_fault made it

    def for_command(self, command: str) -> StorageFault:
        """The same fault, its sentence ending with ``command`` (the one that continues this very run)."""
        return StorageFault(self.message.replace(self.CONTINUE, f"`{command}` continues"), details=self.details)


class Interrupted(OpalctlError):
    """A run stopped by a signal (exit 128 + the signal's number); ``message`` is what the CLI prints after
    ``opalctl: ``, saying which signal and what to type to continue."""

    def __init__(self, signum: int, command: str, *, what: str = "resume", lost: str | None = None):
        self.signal_name = signal.Signals(signum).name
        said = f" {lost}" if lost else ""  # what the stop could not keep (the run's StopSignals says)
        super().__init__(f"interrupted ({self.signal_name}){said}; {what} with: {command}")
        self.exit_code = EXIT_SIGNALLED + int(signum)
