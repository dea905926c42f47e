"""Errors that reach the user as one sentence and an exit code.

The CLI turns each of these into a message on stderr and the documented exit code, never a traceback: the
sentence, then each of ``details`` (if any) on an indented line under it. Anything else that escapes is a bug in
opalctl and is shown as such (exit 1, with the traceback kept for the report).

The exit codes: 0 done; 1 a failure while working (``OpalctlError``) or a bug; 2 bad input (``BadInput``); 3 a
frozen input changed (``InputChanged``); 4 an agent's program hung (``EXIT_PROGRAM_HUNG``): a program call ran past
its time limit and did not stop when interrupted, so the watchdog recorded it (an event and ``opal/hung.jsonl``
naming the version and the call) and ended the process; ``opalctl run ... --resume`` continues from the last
resume checkpoint with that version marked failed (it never runs again); 130 interrupted by the user (Ctrl-C).
"""

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_CHANGED = 3
EXIT_PROGRAM_HUNG = 4  # ended by the agent optimizer's watchdog, see the docstring


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
