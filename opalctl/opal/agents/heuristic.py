"""The heuristic agent: a deterministic, offline agent that edits ``updater.py`` the way an LLM would.

It reads the same facts the message shows (the latest analysis report, the binned loss history, the reason it
was woken) from ``.opal/facts.json`` in the workspace, changes the three settings at the top of the starting
updater (``LR_SCALE``, ``CLIP``, ``ANNEAL_START``) by rewriting those lines of the file, and leaves the same
four-part rationale an LLM must leave. Its rules, checked in this order; the first that fires decides:

1. **Instability** - a non-finite loss, or a loss spike (the window's maximum above 3x the running median, or
   the reason it was woken says so): halve ``LR_SCALE`` and clip gradients at 1.0 (or keep a tighter clip).
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

When ``updater.py`` no longer has those settings (someone rewrote it), the heuristic keeps it and says so.
Same facts, same edit: two runs that reach the same state make the same decisions.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from opalctl.opal.agents.base import Answer, Backend, BackendKind

SETTING = re.compile(r"^(?P<name>LR_SCALE|CLIP|ANNEAL_START)\s*=\s*(?P<value>[^#\n]*?)(?P<comment>\s*#.*)?$",
                     re.MULTILINE)
MATRIX_ROLES = ("matrix", "attention", "mlp", "head", "embedding")
HIGH_RATIO, LOW_RATIO = 3e-2, 1e-4
PLATEAU_START, PLATEAU_SLOPE = 0.3, 0.005
ANNEAL_FROM_PROGRESS, ANNEAL_START = 0.5, 0.8
MAX_SCALE = 8.0
FITTED_SHARE = 1e-3  # a loss below this share of the first interval's mean: the data is fitted (see rule 2)


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


def _fmt(value: float | None) -> str:
    return "None" if value is None else f"{value:.4g}"


class HeuristicBackend(Backend):
    name = "heuristic"
    runs_in = "host"  # it computes: its CPU time must not land on the training process's clock

    def recipe(self) -> dict[str, Any]:
        return {"backend": self.name, "options": {}}

    def decide(self, workspace: Path, message: str, facts: dict[str, Any]) -> Answer:
        if not facts:
            facts_path = Path(workspace) / ".opal" / "facts.json"
            facts = json.loads(facts_path.read_text()) if facts_path.exists() else {}
        updater_path = Path(workspace) / "updater.py"
        source = updater_path.read_text(encoding="utf-8")
        settings = read_settings(source)
        report = facts.get("report") or {}
        window = report.get("loss_window") or {}
        progress = float(facts.get("progress", 0.0))
        observed = self._observed(facts, report, window)
        if settings is None:
            return Answer(rationale=f"Observed: {observed}\nKept: updater.py no longer has the LR_SCALE, CLIP and "
                                    "ANNEAL_START settings this agent edits, so it leaves the program as it is.\n"
                                    "Prediction: training continues under the current program; wrong if the loss "
                                    "rises over the next interval.\nRules: none changed.")
        new = dict(settings)
        change, prediction, rule = self._rule(facts, report, window, progress, settings, new)
        if change is None:
            return Answer(rationale=f"Observed: {observed}\nKept: no rule fired (loss finite and steady, update "
                                    "sizes in the usual range, anneal already set or too early).\n"
                                    "Prediction: the loss keeps its current trend; wrong if it rises by more than "
                                    "10 % over the next interval.\nRules: none changed.")
        updater_path.write_text(write_settings(source, new), encoding="utf-8")
        changes = ", ".join(f"{k} {_fmt(settings[k])} -> {_fmt(new[k])}" for k in ("LR_SCALE", "CLIP", "ANNEAL_START")
                            if settings[k] != new[k])
        return Answer(rationale=f"Observed: {observed}\nChanged: {changes} ({change}).\nPrediction: {prediction}\n"
                                f"Rules: {rule}")

    @staticmethod
    def _observed(facts: dict, report: dict, window: dict) -> str:
        parts = [f"progress {float(facts.get('progress', 0.0)):.2f}"]
        if window.get("mean") is not None:
            parts.append(f"loss mean {window['mean']:.4g} (min {window['min']:.4g}, max {window['max']:.4g})")
        if window.get("nonfinite"):
            parts.append(f"{window['nonfinite']} non-finite loss(es)")
        if report.get("loss_slope_per_100") is not None:
            parts.append(f"slope {report['loss_slope_per_100']:.3g} per 100 updates")
        ratio = _median_ratio(report)
        if ratio is not None:
            parts.append(f"median update/weight {ratio:.3g}")
        if facts.get("reason") and facts["reason"] != "scheduled":
            parts.append(f"woken by: {facts['reason']}")
        return "; ".join(parts) + "."

    @staticmethod
    def _rule(facts, report, window, progress, settings, new):
        reason = str(facts.get("reason") or "")
        bins = (facts.get("losses") or {}).get("bins") or []
        means = [b["mean"] for b in bins if b.get("mean") is not None]
        median = statistics.median(means) if means else None
        spiking = (window.get("nonfinite") or 0) > 0 or "non-finite" in reason or "spike" in reason or (
            median is not None and window.get("max") is not None and window["max"] > 3 * median
            and window["max"] - median > 0.5)
        scale = float(settings["LR_SCALE"])
        if spiking:
            new["LR_SCALE"] = scale * 0.5
            new["CLIP"] = 1.0 if settings["CLIP"] is None else min(float(settings["CLIP"]), 1.0)
            return ("instability: a non-finite loss or a loss spike",
                    "the loss returns below the spike within the next interval; wrong if another spike or "
                    "non-finite loss follows.",
                    "LR_SCALE halving and CLIP 1.0 react to a signal (loss spike or non-finite loss).")
        ratio = _median_ratio(report)
        if ratio is not None and ratio > HIGH_RATIO:
            new["LR_SCALE"] = scale * 0.5
            return (f"update/weight {ratio:.3g} is far above the usual 1e-3..1e-2",
                    "smaller steps lower the loss more steadily; wrong if the loss stops falling.",
                    "LR_SCALE halving reacts to a signal (update-to-weight ratio).")
        start, mean = facts.get("loss_start"), window.get("mean")
        fitted = start is not None and mean is not None and start > 0 and mean < FITTED_SHARE * start
        if ratio is not None and ratio < LOW_RATIO and scale < MAX_SCALE and not fitted:
            new["LR_SCALE"] = min(MAX_SCALE, scale * 2.0)
            return (f"update/weight {ratio:.3g} is far below the usual 1e-3..1e-2",
                    "larger steps make the loss fall faster; wrong if the loss rises or spikes.",
                    "LR_SCALE doubling reacts to a signal (update-to-weight ratio).")
        slope = report.get("loss_slope_per_100")
        mean = window.get("mean")
        if progress >= PLATEAU_START and slope is not None and mean and abs(slope) < PLATEAU_SLOPE * abs(mean) \
                and settings["ANNEAL_START"] is None:
            new["LR_SCALE"] = scale * 0.7
            return ("the loss has plateaued", "a smaller step lets the loss settle lower; wrong if it stays flat.",
                    "LR_SCALE x0.7 reacts to a signal (a flat loss slope).")
        if progress >= ANNEAL_FROM_PROGRESS and settings["ANNEAL_START"] is None:
            new["ANNEAL_START"] = round(max(ANNEAL_START, progress), 4)
            return ("the last part of the budget anneals to zero",
                    "the loss falls further as the learning rate goes to zero; wrong if it rises at the end.",
                    f"ANNEAL_START {new['ANNEAL_START']} is a schedule.")
        return None, None, None


def _median_ratio(report: dict) -> float | None:
    roles = report.get("roles") or {}
    ratios = [v["update_to_weight"] for k, v in roles.items()
              if k in MATRIX_ROLES and v.get("update_to_weight") is not None]
    return statistics.median(ratios) if ratios else None


KIND = BackendKind(name="heuristic", waits=False, factory=HeuristicBackend)
