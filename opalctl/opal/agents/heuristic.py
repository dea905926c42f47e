"""The heuristic agent: a deterministic, offline agent that edits ``updater.py`` the way an LLM would.

It reads the same facts the message shows (the latest analysis report, the binned loss history, the reason it
was woken) from ``.opal/facts.json`` in the workspace, changes the three settings at the top of the starting
updater (``LR_SCALE``, ``CLIP``, ``ANNEAL_START``) by rewriting those lines of the file, and leaves the same
four-part rationale an LLM must leave. Its rules, checked in this order; the first that fires decides:

0. **No loss** - no loss was observed since the last decision (the training loop passed none): it keeps the
   programs and says so; nothing can be said of a trend.
1. **Non-finite loss** - a non-finite loss in the window, or the reason it was woken says so, and
   **spike** - the window's maximum above 3x the median of the binned losses (and more than 0.5 above it), or the
   reason it was woken says so: halve ``LR_SCALE`` and clip gradients at 1.0 (or keep a tighter clip).
   A reaction to a signal.
2. **Update size** - the median update-to-weight ratio over the weight matrices: above 3e-2 (far above the
   usual 1e-3 to 1e-2) halves ``LR_SCALE``; below 1e-4 doubles it (never above 8, and not once the loss is under
   a thousandth of the first interval's: a model that has fit its data takes tiny steps because there is little
   left to learn, and doubling then only brings spikes). A reaction to a signal.
3. **Plateau** - after 30 % of the budget, when the loss slope over the window is flatter than 0.5 % of the
   mean loss per 100 updates: multiply ``LR_SCALE`` by 0.7. A reaction to a signal.
4. **Anneal** - from half the budget on, when no anneal is set: ``ANNEAL_START`` = 0.8 (or now, if later),
   so the learning rate falls linearly to zero over the last part of the budget. A schedule.
5. Otherwise it keeps the programs as they are.

Each decision records which rule decided, on which signal, its value and the threshold it crossed (``Check``):
every check made, in order, goes into the decision's transcript (``decisions/NNN/transcript.json``), the one
that decided marked ``fired``; ``decided_by`` reads it back for ``opalctl show`` and the report page.

When ``updater.py`` no longer has those settings (someone rewrote it), the heuristic keeps it and says so.
Same facts, same edit: two runs that reach the same state make the same decisions.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.opal.agents.base import Answer, Backend, BackendKind
from opalctl.opal.agents.workspace import META_FOLDER
from opalctl.opal.programs import UPDATER
from opalctl.opal.records import FACTS, TRANSCRIPT

SETTING = re.compile(r"^(?P<name>LR_SCALE|CLIP|ANNEAL_START)\s*=\s*(?P<value>[^#\n]*?)(?P<comment>\s*#.*)?$",
                     re.MULTILINE)
MATRIX_ROLES = ("matrix", "attention", "mlp", "head", "embedding")
HIGH_RATIO, LOW_RATIO = 3e-2, 1e-4
SPIKE_FACTOR, SPIKE_MARGIN = 3.0, 0.5
PLATEAU_START, PLATEAU_SLOPE = 0.3, 0.005
ANNEAL_FROM_PROGRESS, ANNEAL_START = 0.5, 0.8
MAX_SCALE = 8.0
FITTED_SHARE = 1e-3  # a loss below this share of the first interval's mean: the data is fitted (see rule 2)
WAKE_SPIKE = re.compile(r"spike: (?P<peak>[-+0-9.eE]+) against a median of (?P<median>[-+0-9.eE]+)")
RULE_EVENT = "rule"  # the transcript entries this agent writes
NO_LOSS_SENTENCE = "no loss was observed; nothing can be said of a trend"


@dataclass(frozen=True)
class Check:
    """One rule checked on one signal: the value seen, the threshold it is held to, and whether it fired.

    This is the record a heuristic decision leaves in its transcript; the check that decided has ``fired``.
    """

    rule: str
    signal: str
    value: float | str | None
    threshold: float | str | None = None
    comparison: str = ""
    fired: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"event": RULE_EVENT, "rule": self.rule, "signal": self.signal, "value": self.value,
                "threshold": self.threshold, "comparison": self.comparison, "fired": self.fired}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Check:
        return cls(rule=str(entry["rule"]), signal=str(entry.get("signal") or ""), value=entry.get("value"),
                   threshold=entry.get("threshold"), comparison=str(entry.get("comparison") or ""),
                   fired=bool(entry.get("fired")))

    def words(self) -> str:
        """``spike: loss window max 5 > 3 (3 x the median)``, or the rule and its signal where no number applies."""
        shown = f"{self.rule}: {self.signal}"
        if self.value is not None:
            shown += f" {_fmt(self.value)}"
        if self.threshold is not None:
            shown += f" {self.comparison or 'vs'} {_fmt(self.threshold)}"
        return shown


def decided_by(decision_folder: str | Path) -> Check | None:
    """The check that decided a heuristic decision, read from its ``transcript.json``; None for a decision of
    another backend (or one whose transcript is gone)."""
    path = Path(decision_folder) / TRANSCRIPT
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    fired = [e for e in entries if isinstance(e, dict) and e.get("event") == RULE_EVENT and e.get("fired")]
    return Check.from_json(fired[-1]) if fired else None


def read_settings(source: str) -> dict[str, Any] | None:
    found = {}
    for match in SETTING.finditer(source):
        text = match.group("value").strip()
        try:
            found[match.group("name")] = None if text == "None" else float(text)
        except ValueError:
            return None
    return found if set(found) == {"LR_SCALE", "CLIP", "ANNEAL_START"} else None


def write_settings(source: str, settings: dict[str, Any]) -> str:
    def replace(match: re.Match) -> str:
        value = settings[match.group("name")]
        shown = "None" if value is None else repr(round(float(value), 10))
        return f"{match.group('name')} = {shown}{match.group('comment') or ''}"

    return SETTING.sub(replace, source)


def _fmt(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.4g}"
    return str(value)


class Signals:
    """What the rules look at, computed once from a decision's facts."""

    def __init__(self, facts: dict[str, Any]):
        report = facts.get("report") or {}
        self.window = report.get("loss_window") or {}
        self.progress = float(facts.get("progress", 0.0))
        self.reason = str(facts.get("reason") or "")
        bins = (facts.get("losses") or {}).get("bins") or []
        means = [b["mean"] for b in bins if b.get("mean") is not None]
        self.median = statistics.median(means) if means else None
        self.ratio = _median_ratio(report)
        self.slope = report.get("loss_slope_per_100")
        self.loss_start = facts.get("loss_start")
        # the observation says how many losses it saw since the last decision; without that field, the bins do
        # (an analysis closes a bin every few updates, with count 0 when no loss came); no bin yet: not known
        observed = facts.get("losses_observed")
        self.losses_observed = int(observed) if observed is not None else (
            sum(int(b.get("count") or 0) for b in bins) if bins else None)

    @property
    def fitted(self) -> bool:
        start, mean = self.loss_start, self.window.get("mean")
        return start is not None and mean is not None and start > 0 and mean < FITTED_SHARE * start

    def observed(self) -> str:
        parts = [f"progress {self.progress:.2f}"]
        if self.losses_observed == 0:
            parts.append(NO_LOSS_SENTENCE)
        if self.window.get("mean") is not None:
            parts.append(f"loss mean {self.window['mean']:.4g} (min {self.window['min']:.4g}, "
                         f"max {self.window['max']:.4g})")
        if self.window.get("nonfinite"):
            parts.append(f"{self.window['nonfinite']} non-finite loss(es)")
        if self.slope is not None:
            parts.append(f"slope {self.slope:.3g} per 100 updates")
        if self.ratio is not None:
            parts.append(f"median update/weight {self.ratio:.3g}")
        if self.reason and self.reason != "scheduled":
            parts.append(f"woken by: {self.reason}")
        return "; ".join(parts) + "."


@dataclass
class Edit:
    """What a fired rule does: the new settings, why in words, what it predicts, and what kind of change it is."""

    settings: dict[str, Any]
    why: str
    prediction: str
    kind: str


Rule = Callable[[Signals, dict[str, Any]], tuple[Check, Edit | None]]


def non_finite(s: Signals, settings: dict[str, Any]) -> tuple[Check, Edit | None]:
    if "non-finite" in s.reason:
        return Check("non-finite loss", "woken by the analysis", s.reason, fired=True), _calm(settings,
                                                                                               "a non-finite loss")
    count = int(s.window.get("nonfinite") or 0)
    check = Check("non-finite loss", "non-finite losses in the window", count, 0, ">", fired=count > 0)
    return check, _calm(settings, "a non-finite loss") if check.fired else None


def spike(s: Signals, settings: dict[str, Any]) -> tuple[Check, Edit | None]:
    peak = s.window.get("max")
    if "spike" in s.reason:
        return _spike_wake(s.reason), _calm(settings, "a loss spike")
    if peak is None or s.median is None:
        return Check("spike", "loss window max", peak, None), None
    threshold = max(SPIKE_FACTOR * s.median, s.median + SPIKE_MARGIN)
    check = Check("spike", "loss window max", peak, threshold, ">", fired=peak > threshold)
    return check, _calm(settings, f"a loss spike, {SPIKE_FACTOR:g}x the median {s.median:.4g}") if check.fired \
        else None


def _spike_wake(reason: str) -> Check:
    """The spike the analysis woke the agent for: the peak and the median the starting analysis names, or the
    reason as it was written (a rewritten analysis may word it otherwise)."""
    told = WAKE_SPIKE.search(reason)
    try:
        return Check("spike", "loss at the wake-up", float(told["peak"]), SPIKE_FACTOR * float(told["median"]), ">",
                     fired=True)
    except (TypeError, ValueError):
        return Check("spike", "woken by the analysis", reason, fired=True)


def _calm(settings: dict[str, Any], what: str) -> Edit:
    clip = 1.0 if settings["CLIP"] is None else min(float(settings["CLIP"]), 1.0)
    return Edit({**settings, "LR_SCALE": float(settings["LR_SCALE"]) * 0.5, "CLIP": clip}, f"instability: {what}",
                "the loss returns below the spike within the next interval; wrong if another spike or non-finite "
                "loss follows.", "LR_SCALE halving and CLIP 1.0 react to a signal (loss spike or non-finite loss).")


def high_updates(s: Signals, settings: dict[str, Any]) -> tuple[Check, Edit | None]:
    check = Check("update size high", "median update/weight ratio", s.ratio, HIGH_RATIO, ">",
                  fired=s.ratio is not None and s.ratio > HIGH_RATIO)
    if not check.fired:
        return check, None
    return check, Edit({**settings, "LR_SCALE": float(settings["LR_SCALE"]) * 0.5},
                       f"update/weight {s.ratio:.3g} is far above the usual 1e-3..1e-2",
                       "smaller steps lower the loss more steadily; wrong if the loss stops falling.",
                       "LR_SCALE halving reacts to a signal (update-to-weight ratio).")


def low_updates(s: Signals, settings: dict[str, Any]) -> tuple[Check, Edit | None]:
    scale = float(settings["LR_SCALE"])
    check = Check("update size low", "median update/weight ratio", s.ratio, LOW_RATIO, "<",
                  fired=s.ratio is not None and s.ratio < LOW_RATIO and scale < MAX_SCALE and not s.fitted)
    if not check.fired:
        return check, None
    return check, Edit({**settings, "LR_SCALE": min(MAX_SCALE, scale * 2.0)},
                       f"update/weight {s.ratio:.3g} is far below the usual 1e-3..1e-2",
                       "larger steps make the loss fall faster; wrong if the loss rises or spikes.",
                       "LR_SCALE doubling reacts to a signal (update-to-weight ratio).")


def plateau(s: Signals, settings: dict[str, Any]) -> tuple[Check, Edit | None]:
    mean = s.window.get("mean")
    flatness = abs(s.slope) / abs(mean) if s.slope is not None and mean else None
    check = Check("plateau", "loss slope per 100 updates / mean loss", flatness, PLATEAU_SLOPE, "<",
                  fired=(s.progress >= PLATEAU_START and flatness is not None and flatness < PLATEAU_SLOPE
                         and settings["ANNEAL_START"] is None))
    if not check.fired:
        return check, None
    return check, Edit({**settings, "LR_SCALE": float(settings["LR_SCALE"]) * 0.7}, "the loss has plateaued",
                       "a smaller step lets the loss settle lower; wrong if it stays flat.",
                       "LR_SCALE x0.7 reacts to a signal (a flat loss slope).")


def anneal(s: Signals, settings: dict[str, Any]) -> tuple[Check, Edit | None]:
    check = Check("anneal", "budget progress", round(s.progress, 4), ANNEAL_FROM_PROGRESS, ">=",
                  fired=s.progress >= ANNEAL_FROM_PROGRESS and settings["ANNEAL_START"] is None)
    if not check.fired:
        return check, None
    start = round(max(ANNEAL_START, s.progress), 4)
    return check, Edit({**settings, "ANNEAL_START": start}, "the last part of the budget anneals to zero",
                       "the loss falls further as the learning rate goes to zero; wrong if it rises at the end.",
                       f"ANNEAL_START {start} is a schedule.")


RULES: tuple[Rule, ...] = (non_finite, spike, high_updates, low_updates, plateau, anneal)


class HeuristicBackend(Backend):
    name = "heuristic"
    runs_in = "host"  # it computes: its CPU time must not land on the training process's clock

    def recipe(self) -> dict[str, Any]:
        return {"backend": self.name, "options": {}}

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        if not facts:
            facts_path = Path(workspace) / META_FOLDER / FACTS
            facts = json.loads(facts_path.read_text()) if facts_path.exists() else {}
        updater_path = Path(workspace) / UPDATER
        source = updater_path.read_text(encoding="utf-8")
        settings = read_settings(source)
        signals = Signals(facts)
        observed = signals.observed()
        if settings is None:
            check = Check("not editable", "updater.py has LR_SCALE, CLIP and ANNEAL_START", "no", fired=True)
            return _kept(observed, "updater.py no longer has the LR_SCALE, CLIP and ANNEAL_START settings this "
                                   "agent edits, so it leaves the program as it is.", [check])
        if signals.losses_observed == 0:
            check = Check("no loss", "losses observed since the last decision", 0, 1, ">=", fired=True)
            return _kept(observed, f"{NO_LOSS_SENTENCE}, so no rule can fire on one and the programs stay as "
                                   "they are.", [check])
        checks = []
        for rule in RULES:
            check, edit = rule(signals, settings)
            checks.append(check)
            if edit is not None:
                break
        else:
            checks.append(Check("none", "no rule fired", None, fired=True))
            return _kept(observed, "no rule fired (loss finite and steady, update sizes in the usual range, "
                                   "anneal already set or too early).", checks)
        updater_path.write_text(write_settings(source, edit.settings), encoding="utf-8")
        changes = ", ".join(f"{k} {_fmt(settings[k])} -> {_fmt(edit.settings[k])}"
                            for k in ("LR_SCALE", "CLIP", "ANNEAL_START") if settings[k] != edit.settings[k])
        return Answer(rationale=f"Observed: {observed}\nChanged: {changes} ({edit.why}; rule "
                                f"{checks[-1].words()}).\nPrediction: {edit.prediction}\nRules: {edit.kind}",
                      transcript=[c.to_json() for c in checks])


def _kept(observed: str, why: str, checks: list[Check]) -> Answer:
    return Answer(rationale=f"Observed: {observed}\nKept: {why}\nPrediction: training continues under the current "
                            "program; wrong if the loss rises by more than 10 % over the next interval.\n"
                            "Rules: none changed.", transcript=[c.to_json() for c in checks])


def _median_ratio(report: dict) -> float | None:
    roles = report.get("roles") or {}
    ratios = [v["update_to_weight"] for k, v in roles.items()
              if k in MATRIX_ROLES and v.get("update_to_weight") is not None]
    return statistics.median(ratios) if ratios else None


KIND = BackendKind(name="heuristic", waits=False, factory=HeuristicBackend)
