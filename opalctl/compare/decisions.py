"""Whether an agent arm acted: its decisions counted from each run folder's records, and what follows from them.

An agent arm whose agent never changed the program trained with its base optimizer alone, bit for bit; a
comparison of it says something about that optimizer, not about the agent. The counts, per run, read from the
run folder as ``opalctl show`` reads it (``driver/show.agent_decisions``: the training process's events and the
agent host's record of each decision, through their bounded readers), partition the decisions asked:

    asked       decisions the run asked of the agent
    applied     its answer changed a program, which loaded and ran on the model (``rolled back`` counts those
                of them reverted afterwards; they ran until then, so they count as applied)
    kept        the agent answered and changed nothing
    failed      no usable answer: the backend failed or refused (an HTTP error, a ``claude`` that exits 1), or
                the programs it answered failed to load
    timed out   no answer in time: past the decision's limit, after the last update, or still pending when the
                run ended

The rules, one place (``ArmDecisions``):

- a seed *acted* when at least one decision was applied there; a seed where the agent *never answered* (no
  decision applied or kept: every one failed or timed out, or none was asked) is left out of the arm's paired
  figures and named, since its run is the base optimizer's with no agent in it; a seed where the agent answered
  but only kept (*declined*) is counted, and named: declining is the agent's own choice, and leaving those seeds
  out would pick seeds by what the agent did;
- an arm that acted on no seed gets no verdict: a sentence saying why stands in its place;
- ``opalctl run`` warns at the end of a run whose agent did not act, and exits ``EXIT_AGENT_NEVER_ANSWERED`` (5)
  when it never answered (a broken key or command: a grid script stops there rather than spend its budget on
  runs with no agent); a run whose agent answered and kept exits 0 with the warning.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opalctl.driver.show import agent_decisions
from opalctl.errors import EXIT_AGENT_NEVER_ANSWERED, EXIT_OK, OpalctlError
from opalctl.formats import Event
from opalctl.layout import RunLayout

COUNTS = ("asked", "applied", "rolled_back", "kept", "failed", "timed_out")
# each count in words, for the legends of compare and the report page (module docstring)
LEGEND = {
    "asked": "decisions the run asked of the agent",
    "applied": "its answer changed a program that loaded and ran on the model",
    "rolled_back": "of those applied, reverted afterwards (a failing program)",
    "kept": "the agent answered and changed nothing",
    "failed": "no usable answer: the backend failed or refused, or the programs answered failed to load",
    "timed_out": "no answer in time: past the decision's limit, after the last update, or pending at the end",
}
# how a decision's failure says it ran out of time (the agent host, the anthropic and claude-code backends: "ran
# past its limit"/"ran past the decision's limit"; a decision the run stopped waiting for: "cancelled:")
TIMEOUT_WORDS = ("ran past", "cancelled:")
NOT_ANSWERED_IN_TIME = (Event.LATE, "pending")
MESSAGE_CHARACTERS = 160


@dataclass
class DecisionTally:
    """One run's decisions, counted (module docstring); ``failure``: the most frequent reason a decision failed or
    timed out, with ``failures`` how many said it."""

    asked: int = 0
    applied: int = 0
    rolled_back: int = 0
    kept: int = 0
    failed: int = 0
    timed_out: int = 0
    failure: str | None = None
    failures: int = 0
    reasons: Counter = field(default_factory=Counter, repr=False, compare=False)

    @classmethod
    def of_entries(cls, entries: list[dict[str, Any]]) -> DecisionTally:
        """The counts of ``show``'s decision entries (``driver/show.agent_decisions``)."""
        tally = cls(asked=len(entries))
        for entry in entries:
            outcome, message = entry.get("outcome"), _first_line(entry.get("message")).removeprefix("failed: ")
            if outcome == Event.APPLIED:
                tally.applied += 1
                tally.rolled_back += entry.get("reverted_at") is not None
            elif outcome == Event.KEPT:
                tally.kept += 1
            elif outcome in (Event.DECISION_FAILED, Event.LOAD_FAILED) and not _timed_out(message):
                tally.failed += 1
                tally.reasons[message or outcome] += 1
            else:  # a failure that ran out of time, late, pending, answered by the host but never applied
                tally.timed_out += 1
                tally.reasons[message or ("the answer came after the last update" if outcome == Event.LATE
                                          else "no answer before the run ended")] += 1
        if tally.reasons:
            tally.failure, tally.failures = tally.reasons.most_common(1)[0]
        return tally

    @classmethod
    def read(cls, run_dir: str | Path) -> DecisionTally | None:
        """The counts of the run in ``run_dir``; None for a run with no agent (a fixed arm's)."""
        layout = RunLayout.of(Path(run_dir))
        entries = agent_decisions(layout.events, layout.decisions)
        return None if entries is None else cls.of_entries(entries)

    @classmethod
    def total(cls, tallies: list[DecisionTally]) -> DecisionTally:
        summed = cls(**{key: sum(getattr(t, key) for t in tallies) for key in COUNTS})
        for tally in tallies:
            summed.reasons.update(tally.reasons)
        if summed.reasons:
            summed.failure, summed.failures = summed.reasons.most_common(1)[0]
        return summed

    @property
    def acted(self) -> bool:
        return self.applied > 0

    @property
    def answered(self) -> bool:
        """Whether the agent gave at least one usable answer (a change applied, or a keep)."""
        return self.applied + self.kept > 0

    @property
    def word(self) -> str:
        """What the agent did in this run, in two words: ``acted``, ``only kept``, ``never answered``."""
        return "acted" if self.acted else "only kept" if self.answered else "never answered"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["reasons"]
        return data

    def said(self) -> str:
        """``0 of 24 decisions applied, 24 failed (HTTP 401 ...)``: the counts that are not zero, in words."""
        parts = [f"{self.applied} of {self.asked} decision{'s' if self.asked != 1 else ''} applied"]
        parts += [f"{self.rolled_back} rolled back"] if self.rolled_back else []
        parts += [f"{self.kept} kept"] if self.kept else []
        for key, words in (("failed", "failed"), ("timed_out", "timed out")):
            if getattr(self, key):
                parts.append(f"{getattr(self, key)} {words}")
        said = ", ".join(parts)
        if self.failure:
            shown = self.failure if len(self.failure) <= MESSAGE_CHARACTERS else \
                self.failure[:MESSAGE_CHARACTERS - 1] + "…"
            said += f" ({shown}" + (f"; {self.failures} said so" if self.failures < self.failed + self.timed_out
                                    else "") + ")"
        return said


def _first_line(message: Any) -> str:
    return str(message).strip().splitlines()[0].strip() if isinstance(message, str) and message.strip() else ""


def _timed_out(message: str) -> bool:
    return any(words in message for words in TIMEOUT_WORDS)


@dataclass
class ArmDecisions:
    """An agent arm's decisions over its finished seeds, and what the comparison makes of them (module docstring).
    ``base``: the arm's base optimizer in words (``AdamW``), what its runs are when the agent never acted."""

    arm: str
    base: str
    seeds: dict[int, DecisionTally]

    @property
    def total(self) -> DecisionTally:
        return DecisionTally.total(list(self.seeds.values()))

    @property
    def acted_seeds(self) -> list[int]:
        return sorted(s for s, t in self.seeds.items() if t.acted)

    @property
    def declined_seeds(self) -> list[int]:
        return sorted(s for s, t in self.seeds.items() if not t.acted and t.answered)

    @property
    def never_answered_seeds(self) -> list[int]:
        """Seeds whose agent never answered (no decision applied or kept)."""
        return sorted(s for s, t in self.seeds.items() if not t.answered)

    @property
    def left_out_seeds(self) -> list[int]:
        """Seeds left out of the arm's paired figures: those whose agent never answered, when it acted on another
        (an arm that acted on none keeps its figures, which are its base optimizer's, and gets no verdict)."""
        return [] if self.instead_of_verdict else self.never_answered_seeds

    @property
    def instead_of_verdict(self) -> str | None:
        """The sentence that stands in for the verdict of an arm that acted on no seed; None when it acted."""
        if self.acted_seeds or not self.seeds:
            return None
        on = f" on {len(self.seeds)} seeds" if len(self.seeds) > 1 else ""
        return (f"agent arm {self.arm} never acted: {self.total.said()}{on}; its runs are the base optimizer's "
                f"({self.base}), so a verdict would be about {self.base}, not the agent.")

    @property
    def note(self) -> str:
        """What a verdict of an arm that acted on some seeds must say of the others ('' when it acted on all)."""
        if self.instead_of_verdict:
            return ""
        said = []
        if self.left_out_seeds:
            said.append(f"seed{_plural(self.left_out_seeds)} {_seeds(self.left_out_seeds)} left out: the agent of "
                        f"{self.arm} never answered there ({_tallies(self, self.left_out_seeds)}), so "
                        f"{'those runs are' if len(self.left_out_seeds) > 1 else 'that run is'} {self.base} alone")
        if self.declined_seeds:
            said.append(f"on seed{_plural(self.declined_seeds)} {_seeds(self.declined_seeds)} the agent answered but "
                        f"changed nothing ({_tallies(self, self.declined_seeds)}); counted, as the agent's choice")
        text = "; ".join(said)
        return f" {text[0].upper()}{text[1:]}." if said else ""

    def to_json(self) -> dict[str, Any]:
        return {"seeds": {str(s): t.to_json() for s, t in sorted(self.seeds.items())},
                "total": self.total.to_json(), "acted_seeds": self.acted_seeds,
                "declined_seeds": self.declined_seeds, "never_answered_seeds": self.never_answered_seeds,
                "left_out_seeds": self.left_out_seeds,
                "no_verdict": self.instead_of_verdict, "note": self.note.strip() or None}


def _seeds(seeds: list[int]) -> str:
    return ", ".join(map(str, seeds))


def _plural(seeds: list[int]) -> str:
    return "s" if len(seeds) > 1 else ""


def _tallies(arm: ArmDecisions, seeds: list[int]) -> str:
    return DecisionTally.total([arm.seeds[s] for s in seeds]).said()


def base_words(arm_config: dict[str, Any]) -> str:
    """An arm's base optimizer in words, from its resolved config: ``AdamW`` (``AdamW with anneal-end``)."""
    optimizer = arm_config.get("optimizer") or {}
    name = str(optimizer.get("name") or "the base optimizer")
    schedule = arm_config.get("schedule")
    return f"{name} with {schedule}" if isinstance(schedule, str) and schedule not in ("", "constant") else name


def arm_decisions(arm: str, arm_config: dict[str, Any], run_dirs: dict[int, Path]) -> ArmDecisions | None:
    """The arm's decisions over ``run_dirs`` (seed -> its finished run folder); None for a fixed arm."""
    if not arm_config.get("agent"):
        return None
    tallies = {seed: DecisionTally.read(folder) for seed, folder in run_dirs.items()}
    return ArmDecisions(arm, base_words(arm_config), {s: t or DecisionTally() for s, t in tallies.items()})


# -- the end of one run ------------------------------------------------------------------------------------------

@dataclass
class RunEnding:
    """What ``opalctl run`` says at the end of one run of an agent arm: its counts, the warning, the exit code."""

    decisions: DecisionTally | None
    warning: str | None
    exit_code: int

    @classmethod
    def of(cls, arm: str, seed: int, arm_config: dict[str, Any], run_dir: str | Path) -> RunEnding:
        if not arm_config.get("agent"):
            return cls(None, None, EXIT_OK)
        try:
            tally = DecisionTally.read(run_dir) or DecisionTally()
        except OpalctlError as error:  # the run is finished whatever its records say; `opalctl verify` tells more
            return cls(None, f"the decisions of arm {arm} on seed {seed} could not be counted: {error.message}",
                       EXIT_OK)
        if tally.acted:
            return cls(tally, None, EXIT_OK)
        base = base_words(arm_config)
        if tally.answered:
            warning = (f"the agent of arm {arm} never acted on seed {seed}: {tally.said()}; this run is {base} "
                       f"alone, and compare gives an arm that acted on no seed no verdict")
            return cls(tally, warning, EXIT_OK)
        warning = (f"the agent of arm {arm} never answered on seed {seed}: {tally.said()}; this run is {base} "
                   f"alone (its folder is complete and verifies), and compare counts it as no result of the agent; "
                   f"fix the agent's backend, move {run_dir} aside and run this seed again (exit "
                   f"{EXIT_AGENT_NEVER_ANSWERED})")
        return cls(tally, warning, EXIT_AGENT_NEVER_ANSWERED)

    def to_json(self) -> dict[str, Any]:
        return {"decisions": None if self.decisions is None else self.decisions.to_json(),
                "warning": self.warning, "exit_code": self.exit_code}


# -- what a grid or the demo says of a comparison -----------------------------------------------------------------

def agent_warnings(comparison: dict[str, Any] | None) -> list[str]:
    """One sentence per agent arm of a ``compare`` result that did not act on every seed (its ``no_verdict`` or its
    ``note``), for the end of a grid and of the demo."""
    if comparison is None:
        return []
    return [decisions["no_verdict"] or f"agent arm {arm['arm']}: {decisions['note']}"
            for arm in comparison["arms"] if (decisions := arm.get("decisions"))
            and (decisions["no_verdict"] or decisions["note"])]


def never_answered(comparison: dict[str, Any] | None) -> bool:
    """Whether a run of the comparison's agent arms never answered (``EXIT_AGENT_NEVER_ANSWERED`` for a grid)."""
    return comparison is not None and any((arm.get("decisions") or {}).get("never_answered_seeds")
                                          for arm in comparison["arms"])
