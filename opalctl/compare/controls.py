"""What an agent arm's applied programs amount to: a fixed schedule the protocol could have written, or not.

An agent arm's result means "the agent adapted to the run" only when no fixed arm could have done the same. This
module decides, for every run of an agent arm, whether its applied programs equal a fixed schedule the protocol can
express (a built-in ``schedule``, with the learning rate scaled by a constant), on top of the arm's own optimizer and
schedule, and names the control arm that is that schedule (in the lock, or missing).

The decision is sound, never a guess from the agent's words:

- every applied ``updater.py`` must be the starting updater (``opal/defaults/updater.py``) except for the values of
  its settings lines (``LR_SCALE``, ``CLIP``, ``ANNEAL_START``): compared after parsing, each setting's value removed
  from both trees, so a comment or spacing may differ but no statement may;
- every applied ``analysis.py`` must be the starting analysis (it only reads, but another one may wake the agent at
  other times, and its code is not looked into);
- ``CLIP`` must stay None (a clip is not a learning-rate schedule, and the protocol's clip is the whole lock's);
- no version was reverted and no step failed (a revert restores weights; what ran is then no single program).

Then the effective learning-rate factor at every update of the run is computed (the arm's own schedule times the
running program's factor, each at the budget fraction the run had used before that update, with each version from
the update its ``applied`` event names) and compared with every built-in schedule times a constant, at every update.
The tolerance is relative, ``TOLERANCE`` (1e-9): the starting updater's anneal divides by ``1 - ANNEAL_START`` and
the built-in ``anneal-end`` by 0.2, and ``1 - 0.8`` is 0.19999999999999996 in binary, so the two differ by a few
parts in 1e16; any change a setting can make is many orders larger. Anything else (an LLM agent's own code, another
analysis, a revert) is "not reducible to a fixed schedule", said with the reason.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.driver.arm import Schedule
from opalctl.driver.records import read_steps
from opalctl.errors import OpalctlError
from opalctl.formats import Event, read_jsonl
from opalctl.layout import RunLayout
from opalctl.opal.programs import ANALYSIS, UPDATER, default_sources

SETTINGS = ("LR_SCALE", "CLIP", "ANNEAL_START")
BUILT_IN_SCHEDULES = ("constant", "anneal-end", "cosine", "linear")  # the order a match is looked for in
TOLERANCE = 1e-9
NOT_ONE_PROGRAM = ("reverted", "failed_step")  # events after which what ran is no single program


# --------------------------------------------------------------------------------------------------------------
# the programs

def updater_settings(source: str, starting: str) -> dict[str, float | None] | str:
    """The settings of ``source`` when it is ``starting`` except for the values of its settings lines, else the
    reason it is not (a sentence)."""
    mine, why = _settings_removed(source)
    if mine is None:
        return why
    theirs, why = _settings_removed(starting)
    if theirs is None:  # pragma: no cover - the shipped starting updater has its settings
        return f"the starting updater {why}"
    if ast.dump(mine[0]) != ast.dump(theirs[0]):
        return "its updater.py is not the starting updater with other settings (its code was changed)"
    return mine[1]


def _settings_removed(source: str) -> tuple[tuple[ast.Module, dict[str, float | None]] | None, str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None, "does not parse as Python"
    found: dict[str, float | None] = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in SETTINGS):
            continue
        name = node.targets[0].id
        value = _constant(node.value)
        if name in found or value is False:
            return None, f"sets {name} to something other than one number or None"
        found[name] = value
        node.value = ast.Constant(value=None)
    if set(found) != set(SETTINGS):
        return None, f"lacks the settings lines {', '.join(s for s in SETTINGS if s not in found)}"
    return (tree, found), ""


def _constant(node: ast.AST) -> float | None | bool:
    """A setting's value: a number or None; False for anything else (an expression is not looked into)."""
    negative = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    if negative:
        node = node.operand
    if not isinstance(node, ast.Constant):
        return False
    value = node.value
    if value is None and not negative:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return -float(value) if negative else float(value)
    return False


def setting_factor(settings: dict[str, float | None], progress: float) -> float:
    """The starting updater's ``Updater.factor`` with these settings (a test holds the two equal)."""
    factor = settings["LR_SCALE"]
    start = settings["ANNEAL_START"]
    if start is not None and progress > start:
        factor = factor * max(0.0, (1.0 - progress) / (1.0 - start))
    return factor


# --------------------------------------------------------------------------------------------------------------
# the factor at every update, and the fixed schedule it equals

@dataclass(frozen=True)
class Switch:
    """A program version's settings, running from update ``update`` (0-based: the first update it stepped)."""

    update: int
    settings: dict[str, float | None]


def effective_factors(switches: Sequence[Switch], fractions: Sequence[float], arm_schedule: str) -> list[float]:
    """The learning-rate factor of every update: the arm's own schedule times the running program's factor, both at
    the budget fraction used before that update (``fractions[u]``, as the run's meter gave it)."""
    ordered = sorted(switches, key=lambda s: s.update)
    factors, current, index = [], None, 0
    for update, fraction in enumerate(fractions):
        while index < len(ordered) and ordered[index].update <= update:
            current = ordered[index].settings
            index += 1
        program = 1.0 if current is None else setting_factor(current, fraction)
        factors.append(Schedule.of(arm_schedule).factor(fraction) * program)
    return factors


def close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b))


def fixed_equivalent(factors: Sequence[float], fractions: Sequence[float],
                     own: str | dict[str, Any] | None = None) -> tuple[str | dict[str, Any], float] | None:
    """``(schedule, scale)``: the first built-in schedule, or else the arm's own when it is a mapping (a warm-up,
    a floor, wsd), that, times a constant, gives ``factors`` at every update (within ``TOLERANCE``); None when
    none does."""
    if not factors:
        return None
    for name in BUILT_IN_SCHEDULES + ((own,) if isinstance(own, dict) else ()):
        shape = [Schedule.of(name).factor(f) for f in fractions]
        anchor = next((i for i, s in enumerate(shape) if s != 0.0), None)
        if anchor is None:
            continue
        scale = factors[anchor] / shape[anchor]
        if scale > 0 and all(close(f, scale * s) for f, s in zip(factors, shape)):
            return name, (1.0 if close(scale, 1.0) else scale)
    return None


# --------------------------------------------------------------------------------------------------------------
# one run, from its records

@dataclass
class RunEquivalence:
    """What one agent run's applied programs amount to: ``schedule`` and ``scale`` when a fixed schedule, else
    ``reason`` (why not)."""

    seed: int
    schedule: str | dict[str, Any] | None = None  # a name, or the arm's own mapping
    scale: float = 1.0
    reason: str | None = None
    applied: int = 0  # versions applied after the starting one

    def words(self) -> str:
        if self.schedule is None:
            return f"not reducible to a fixed schedule ({self.reason})"
        return f"fixed schedule `{Schedule.of(self.schedule).words()}`" + (
            "" if self.scale == 1.0 else f" with the learning rate x{self.scale:.6g}")

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "schedule": self.schedule, "scale": self.scale, "reason": self.reason,
                "applied": self.applied}


def run_equivalence(run_dir: Path, seed: int, arm_schedule: str | dict[str, Any], total: float,
                    starting: dict[str, str] | None = None) -> RunEquivalence:
    """Read one agent run's records (its events, program versions and steps) and decide."""
    starting = starting or default_sources()
    layout = RunLayout(run_dir)
    found = RunEquivalence(seed=seed)
    try:
        events = list(read_jsonl(layout.events))
    except (OSError, OpalctlError) as error:
        found.reason = f"its events cannot be read ({error})"
        return found
    stopped = next((e for e in events if e.get("kind") in NOT_ONE_PROGRAM), None)
    if stopped is not None:
        found.reason = f"a program was {stopped['kind'].replace('_', ' ')} at update {stopped.get('update')}"
        return found
    versions = [(0, 0)] + [(int(e["update"]), int(e["version"])) for e in events if e.get("kind") == Event.APPLIED]
    found.applied = len(versions) - 1
    switches = []
    for update, version in versions:
        folder = layout.program_version(version)
        try:
            updater = (folder / UPDATER).read_text(encoding="utf-8")
            analysis = (folder / ANALYSIS).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            found.reason = f"version {version}'s programs are not in the run's records ({folder})"
            return found
        settings = updater_settings(updater, starting[UPDATER])
        if isinstance(settings, str):
            found.reason = f"version {version}: {settings}"
            return found
        if analysis != starting[ANALYSIS]:
            found.reason = f"version {version}: its analysis.py is not the starting analysis"
            return found
        if settings["CLIP"] is not None:
            found.reason = f"version {version} clips gradients at {settings['CLIP']:g}, which no schedule does"
            return found
        switches.append(Switch(update, settings))
    try:
        used = [0.0] + [float(row["used"]) for row in read_steps(layout.steps)]
    except (OSError, ValueError, KeyError, TypeError) as error:
        found.reason = f"its steps cannot be read ({error})"
        return found
    fractions = [u / total for u in used[:-1]]  # the fraction used before each update, as the meter divides it
    factors = effective_factors(switches, fractions, arm_schedule)
    match = fixed_equivalent(factors, fractions, arm_schedule)
    if match is None:
        found.reason = _why_not(switches[1:], fractions)
        return found
    found.schedule, found.scale = match
    return found


def _why_not(changed: list[Switch], fractions: Sequence[float]) -> str:
    if not changed:  # pragma: no cover - no change is the arm's own schedule, which always matches
        return "no program applied"
    first = changed[0]
    where = fractions[first.update] if first.update < len(fractions) else 1.0
    shown = ", ".join(f"{k} {v:g}" if v is not None else f"{k} None" for k, v in first.settings.items())
    return (f"{shown} from update {first.update} ({where:.0%} of the budget): the learning rate changes at a point "
            f"no built-in schedule changes it")


# --------------------------------------------------------------------------------------------------------------
# an arm: every seed, and the control arm it names

def fixed_arm(arm: dict[str, Any], schedule: str | dict[str, Any], scale: float) -> dict[str, Any]:
    """The resolved fixed arm that is ``schedule`` times ``scale`` on the agent arm's optimizer (no agent)."""
    optimizer = dict(arm["optimizer"])
    if scale != 1.0:
        optimizer["lr"] = optimizer["lr"] * scale
    return {**{k: v for k, v in arm.items() if k != "agent"}, "optimizer": optimizer, "schedule": schedule,
            "agent": None}


def same_arm(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if set(a) - {"agent"} != set(b) - {"agent"} or a.get("agent") or b.get("agent"):
        return False
    for key in a:
        if key == "optimizer":
            x, y = a[key], b[key]
            if set(x) != set(y) or any(not (x[k] == y[k] or (k == "lr" and close(float(x[k]), float(y[k]))))
                                       for k in x):
                return False
        elif a[key] != b[key]:
            return False
    return True


def fixed_arm_name(arm_name: str, arm: dict[str, Any], schedule: str | dict[str, Any], scale: float) -> str:
    """A name for the missing control arm: the optimizer's, lower case, then the schedule (``adamw-anneal-end``)."""
    shown = schedule if isinstance(schedule, str) else f"{schedule['name']}-recipe"
    name = f"{arm['optimizer']['name'].lower()}-{shown}"
    return name if scale == 1.0 else f"{name}-x{scale:.3g}".replace(".", "p")


def arm_controls(arm_name: str, runs: list[RunEquivalence], arms: dict[str, dict[str, Any]],
                 post_hoc_arms: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The result for one agent arm: each seed's equivalence, the fixed schedule they share (if all do), the
    control arm in the lock (or None, with the name it would take) and one sentence."""
    runs = sorted(runs, key=lambda r: r.seed)
    shared = {(json.dumps(r.schedule, sort_keys=True), r.scale) for r in runs}  # a mapping is no set member
    result: dict[str, Any] = {"arm": arm_name, "seeds": [r.to_json() for r in runs], "schedule": None, "scale": None,
                              "control_arm": None, "control_in": None, "missing_arm": None}
    if runs and len(shared) == 1 and runs[0].schedule is not None:
        schedule, scale = runs[0].schedule, runs[0].scale
        wanted = fixed_arm(arms[arm_name], schedule, scale)
        result.update(schedule=schedule, scale=scale)
        present = next((n for n, a in arms.items() if n != arm_name and same_arm(a, wanted)), None)
        later = next((n for n, a in (post_hoc_arms or {}).items() if same_arm(a, wanted)), None)
        what = runs[0].words()
        every = f"all {len(runs)} seeds" if len(runs) > 1 else "its one seed"
        if present is not None:
            result.update(control_arm=present, control_in="lock")
            tail = (f"control arm `{present}` present in the lock (`opalctl compare LOCK --baseline {present}` pairs "
                    f"the agent with it)")
        elif later is not None:
            result.update(control_arm=later, control_in="post-hoc")
            tail = f"control arm `{later}` added after the fact (post-hoc, in the control lock; compare it)"
        else:
            result["missing_arm"] = {"name": fixed_arm_name(arm_name, arms[arm_name], schedule, scale),
                                     "arm": wanted}
            tail = ("no such arm in this lock: add one, or run the post-hoc control (`opalctl control LOCK --arm "
                    f"{arm_name}`)")
        result["sentence"] = f"{arm_name}'s applied programs equal {what} on {every}; {tail}"
        return result
    parts = [f"seed {r.seed}: {r.words()}" for r in runs]
    result["sentence"] = (f"{arm_name}'s applied programs are not one fixed schedule on every seed ("
                          + "; ".join(parts) + "): what it did on one seed can be replayed on the others "
                          f"(`opalctl control LOCK --arm {arm_name}`)")
    return result


def lock_controls(lock, base: Path, finished: dict[str, dict[int, dict]],
                  post_hoc_arms: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Every agent arm of ``lock`` with finished runs: ``arm_controls`` of its runs (compare calls this)."""
    protocol = lock.resolved
    arms = protocol["arms"]
    total_of = {name: float(protocol["budget"]["amount"]) * float(arm.get("budget_multiplier", 1.0))
                for name, arm in arms.items()}
    starting = default_sources()
    out = {}
    for name, arm in arms.items():
        if not arm.get("agent") or name not in finished:
            continue
        runs = [run_equivalence(base / name / f"seed-{seed}", seed, arm.get("schedule", "constant"), total_of[name],
                                starting) for seed in sorted(finished[name])]
        out[name] = arm_controls(name, runs, arms, post_hoc_arms)
    return out


POST_HOC = "post-hoc control, added after the fact, not pre-registered"


def verdict_pointer(sentence: str, controls: dict[str, Any] | None, post_hoc: bool = False) -> str:
    """A verdict sentence with what the controls say about its arm: a post-hoc arm is marked as one, and an agent
    arm whose programs equal a fixed schedule points at that (its ``controls`` line says which arm is the control)."""
    if post_hoc:
        sentence = f"{sentence} [{POST_HOC}]"
    if controls and controls.get("schedule") is not None:
        control = controls.get("control_arm")
        sentence += (f" But its applied programs equal the fixed schedule `{Schedule.of(controls['schedule']).words()}`"
                     + (f": compare it with the control arm `{control}`" if control else ", and no control arm ran it")
                     + " (see controls).")
    return sentence
