"""The user's optimizer and scheduler as a checkpoint saves them: state that a program may have polluted.

They are the user's objects, but every program is handed them (``spec.optimizer``, ``spec.scheduler``) and may
leave anything in them: a function in a parameter's state, a meta tensor for a moment, a hook. So at a checkpoint
their ``state_dict()`` runs under the guard (with the running version's time limit: a hook of the program's that
never returns is that version's hang) and what it returns is reduced to plain data (``plain.py``).

What is left out, and why that way rather than restoring a snapshot: a snapshot of the user's optimizer exists only
during a trial or after an analysis check, and restoring one would move the parameters back too. Leaving out the
smallest part that can be left out keeps everything else as it is:

- the user's optimizer: a parameter's state that is not plain data is left out whole (it starts afresh at the next
  step, as torch's optimizers start a parameter they have not stepped), a group setting takes the optimizer's
  default (``plain_optimizer_state``); the reduced state is loaded back into the live optimizer, so the
  program's objects are gone from it and the next checkpoint finds nothing;
- the scheduler: an entry that is not plain data is left out of the checkpoint (``load_state_dict`` updates only
  the entries given, so a resumed scheduler keeps the value it was built with). The live scheduler keeps it (its
  attributes are its own to set), and an entry is said once: the entries that were not plain data when the
  optimizer was wrapped are the user's own and never said.

What was left out is the running program's failure (the optimizer reverts it; ``Recovery.output_refused``).
"""

from __future__ import annotations

from typing import Any

from opalctl.opal.guard import failure_text, method_call
from opalctl.opal.plain import plain_copy, plain_entries, plain_optimizer_state, plain_problem, string_keyed

SHOWN = 3  # what was left out, named in a failure's message; the rest counted


def said(left_out: list[str]) -> str:
    """The first few of what was left out, and how many more."""
    more = len(left_out) - SHOWN
    return "; ".join(left_out[:SHOWN]) + (f"; and {more} more" if more > 0 else "")


class UserState:
    """The user's optimizer and scheduler (``spec``'s), their settings as they were when wrapped, and the scheduler
    entries left out of checkpoints so far."""

    def __init__(self, spec, guard):
        self.spec = spec
        self.guard = guard
        # the defaults the optimizer was built with, read before any program ran (a group setting falls back on them)
        self.defaults = {key: plain_copy(value) for key, value in string_keyed(spec.optimizer.defaults).items()
                         if plain_problem(value) is None}
        self.scheduler_left_out: set[Any] = set()
        if spec.scheduler is not None:
            _, left_out = plain_entries(spec.scheduler.state_dict(), "the scheduler")
            self.scheduler_left_out = set(left_out)  # the user's own: left out of checkpoints, never said

    def checked(self, version) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[str]]:
        """``(the optimizer's state, the scheduler's state, what a program left in them that was left out)``, each
        state plain data (None: none could be taken); ``version`` is the running one."""
        base, problems = self._optimizer_state(version)
        scheduler = None
        if self.spec.scheduler is not None:
            scheduler, left_out = self._taken(version, self.spec.scheduler, "the scheduler")
            if scheduler is not None:
                scheduler, left_out = plain_entries(scheduler, "the scheduler")
            new = [entry for entry in left_out if entry not in self.scheduler_left_out]
            self.scheduler_left_out.update(new)
            problems += new
        return base, scheduler, problems

    def _optimizer_state(self, version) -> tuple[dict[str, Any] | None, list[str]]:
        optimizer = self.spec.optimizer
        taken, problems = self._taken(version, optimizer, "the user's optimizer")
        if taken is None:
            return None, problems
        base, left_out = plain_optimizer_state(taken, self.defaults)
        if left_out and base is not None:
            _, error = self.guard.call(version, "the user's optimizer's load_state_dict()", method_call, optimizer,
                                       "load_state_dict", base, charged=False)
            if error is not None:
                left_out.append(f"(the optimizer could not take its cleared state back: {failure_text(error)})")
        return base, left_out

    def _taken(self, version, owner, what: str) -> tuple[Any, list[str]]:
        """``owner.state_dict()`` under the guard: (its value, []) or (None, [why it failed])."""
        value, error = self.guard.call(version, f"{what}'s state_dict()", method_call, owner, "state_dict",
                                       charged=False)
        if error is not None:
            return None, [f"{what}'s state_dict() raised {failure_text(error)}"]
        return value, []
