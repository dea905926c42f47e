"""``opalctl compare LOCK``: the arms of one frozen protocol side by side, across seeds, paired by seed.

Only runs made from this very lock are read (their folder is named after the lock's digest, and each report
names the lock's sha256, which is checked), so a comparison can never mix protocols. The selected model of
each run (the last promoted stage, or the anchor when none qualified) is what is compared: that is the model the
pre-registered policy would hand over; ``--stage last`` or ``--stage N`` compares another stage instead
(``values``). Every metric the task reports is compared, with the final training loss. Paired differences to
the baseline are taken seed by seed, each with its verdict in words (``verdict``).

Each run folder is checked before its report is used, as ``opalctl verify`` checks it without opening the
checkpoints (verify/folder.py): a report whose chain of digests names a stage record, the steps file or a
checkpoint that no longer matches, or whose own figures were edited, is refused in one sentence naming the file
(exit 3; exit 1 for a record that cannot be read), so compare never shows what ``show`` would not. A report
written before the chain (no ``digests``, stages without ``anchor_sha256``) is read tolerantly: only the keys
compare needs (``REPORT_KEYS``, and in each stage its ``metrics`` and seconds) must be there; a report that lacks
one of those is refused as damaged, naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opalctl.choices import known_only
from opalctl.compare.controls import lock_controls, verdict_pointer
from opalctl.compare.decisions import arm_decisions
from opalctl.compare.flags import outside_cpu, outside_work_flag, run_flags, unconfined_note
from opalctl.compare.refusals import anchor_note
from opalctl.compare.statistics import paired, summary, time_to_reach
from opalctl.compare.target import TargetRule, arm_budget, arm_figure, arm_times
from opalctl.compare.values import TRAIN_LOSS, final_train_loss, parse_stage, stage_metrics
from opalctl.compare.verdict import verdict
from opalctl.driver.budget import clock_spec
from opalctl.errors import BadInput
from opalctl.files import read_plain
from opalctl.formats import EVENTS_MAX_BYTES, REPORT_MAX_BYTES, RecordDamaged, read_record
from opalctl.layout import LockRuns, RunLayout, runs_dir_default
from opalctl.opal.notes import notes_flag
from opalctl.protocol.control import control_locks
from opalctl.protocol.lock import read_lock
from opalctl.tasks import load_task_class
from opalctl.verify.folder import checked_run_folder

# the fields of a RunReport that compare reads (a test checks they are RunReport's)
REPORT_KEYS = ("lock_sha256", "updates", "seconds", "budget", "promoted_stages", "selected", "stages",
               "anchor_metrics")
# the agent figures compare summarises across seeds (fields of AgentFigures)
AGENT_KEYS = ("decisions_asked", "decisions_applied", "decisions_reverted", "waiting_seconds", "cost_usd")


def _metric_directions(lock, reports: list[dict], chosen: list[str] | None) -> dict[str, bool]:
    """Every metric the task reports (the policy's first, then the rest in report order), each with True when
    higher is better, and ``train.loss``; a metric of kind ``count`` (a denominator: the rows evaluated) is left
    out. ``chosen`` (``--metric``) keeps only those, in its order."""
    protocol = lock.protocol()
    selection = protocol.selection
    kinds = load_task_class(protocol.task.entry).metrics
    names: list[str] = []
    for name in list(selection.improve_any) + list(selection.nondecreasing) + list(selection.floors) + \
            list(selection.nonincreasing) + [m for r in reports for m in r["anchor_metrics"]]:
        if name not in names and kinds.get(name.partition(".")[2]) != "count":
            names.append(name)
    directions = {name: not (name in selection.nonincreasing or kinds.get(name.partition(".")[2]) == "lower")
                  for name in names}
    directions[TRAIN_LOSS] = False
    if not chosen:
        return directions
    chosen = known_only(chosen, directions, lambda name, names: f"--metric {name!r} is not a metric of "
                        f"{lock.path}'s runs; give one of {', '.join(names)}")
    return {name: directions[name] for name in chosen}


def collect(lock, runs_dir: Path) -> tuple[Path, dict[str, dict[int, dict]], dict[str, list[int]]]:
    runs_of = LockRuns.of(runs_dir, lock)
    base = runs_of.base
    if not base.is_dir():
        raise BadInput(f"there are no runs of lock {lock.path} under {runs_dir} (looked for {base}); run "
                       f"`opalctl run {lock.path} --arm ARM --seed SEED` first")
    finished: dict[str, dict[int, dict]] = {}
    unfinished: dict[str, list[int]] = {}
    for arm in lock.resolved["arms"]:
        for layout in runs_of.seeds_of(arm):
            folder, seed = layout.root, int(layout.root.name.removeprefix("seed-"))
            report_path = layout.report
            if not report_path.exists():
                if layout.last.exists() or layout.selected.exists():
                    checked_run_folder(folder)  # a run that closed and lost its report is refused, not "unfinished"
                # an unfinished run (interrupted, failed, its resume checkpoint damaged) is counted, never read:
                # `opalctl verify` or `--resume` tells what is wrong with it
                unfinished.setdefault(arm, []).append(seed)
                continue
            report = read_report(report_path)
            if report.get("lock_sha256") != lock.sha256:
                raise BadInput(f"run {folder} was made from lock {str(report.get('lock_sha256'))[:12]}, not "
                               f"{lock.sha12} ({lock.path}); compare only runs of one lock")
            if _chained(report):
                checked_run_folder(folder)
            finished.setdefault(arm, {})[seed] = report
    if not finished:
        raise BadInput(f"no finished runs of lock {lock.path} under {base}; finish at least one run first")
    return base, finished, unfinished


def _chained(report: dict[str, Any]) -> bool:
    """Whether a report belongs to the chain of digests (it, or one of its stages, names a digest of it)."""
    stages = report.get("stages")
    return report.get("digests") is not None or (isinstance(stages, list) and any(
        isinstance(stage, dict) and "anchor_sha256" in stage for stage in stages))


def read_report(path: Path) -> dict[str, Any]:
    """A run's ``report.json``, with at least the keys compare reads (``RecordDamaged`` naming the file if not)."""
    report = read_record(path, advice="the record is damaged (run the arm again)", limit=REPORT_MAX_BYTES)
    if not isinstance(report, dict):
        raise RecordDamaged(f"{path} is not a JSON object; the record is damaged (run the arm again)")
    missing = [key for key in REPORT_KEYS if key not in report]
    if missing:
        raise RecordDamaged(f"{path} lacks {', '.join(missing)}; the record is damaged (run the arm again)")
    return report


def _curve(report: dict, metric: str, seconds_key: str) -> list[tuple[float, float]]:
    return [(stage[seconds_key], stage["metrics"][metric]) for stage in report["stages"] if metric in stage["metrics"]]


def compare(lock_path: str | Path, *, baseline: str | None = None, runs_dir=None, stage: str | int | None = None,
            metrics: list[str] | None = None, resamples: int = 10_000) -> dict[str, Any]:
    lock = read_lock(Path(lock_path))
    runs_dir = runs_dir_default(runs_dir)
    stage = parse_stage(stage)
    base, finished, unfinished = collect(lock, runs_dir)
    arms = [arm for arm in lock.resolved["arms"] if arm in finished]
    baseline = _baseline(lock, baseline, arms, finished)
    directions = _metric_directions(lock, [r for arm in arms for r in finished[arm].values()], metrics)
    values = {arm: {seed: _run_values(base / arm / f"seed-{seed}", report, stage)
                    for seed, report in finished[arm].items()} for arm in arms}
    clock = lock.resolved["budget"]["clock"]
    seconds_key = clock_spec(clock).compare_seconds
    primary = next((m for m in directions if m != TRAIN_LOSS), None)
    post_hoc = post_hoc_runs(lock, runs_dir, stage)  # the control locks' runs (opalctl control), marked post-hoc
    controls = lock_controls(lock, base, finished, {n: a for c in post_hoc for n, a in c["arms"].items()})
    for control in post_hoc:
        for arm in control["finished"]:
            finished[arm], unfinished[arm] = control["finished"][arm], control["unfinished"].get(arm, [])
            values[arm] = control["values"][arm]
            arms.append(arm)
    base_of = {arm: control["base"] for control in post_hoc for arm in control["finished"]}
    arm_specs = {**{n: a for c in post_hoc for n, a in c["arms"].items()}, **lock.resolved["arms"]}
    rows = []
    for arm in arms:
        entry = _arm_row(arm, baseline, finished, unfinished)
        entry["post_hoc"] = base_of.get(arm) is not None
        # a post-hoc arm's runs are its control lock's (the lock's own arms' are under "runs" of the result)
        entry["runs"] = str(base_of[arm]) if entry["post_hoc"] else None
        entry["controls"] = controls.get(arm)
        arm_base = base_of.get(arm, base)
        # an agent arm's decisions, read from its run folders: a seed whose agent never answered is left out of its
        # paired figures, and an arm that acted on no seed gets no verdict (compare/decisions.py)
        decided = arm_decisions(arm, arm_specs[arm], {s: arm_base / arm / f"seed-{s}" for s in finished[arm]})
        entry["decisions"] = None if decided is None else decided.to_json()
        left_out = set(decided.left_out_seeds) if decided is not None and arm != baseline else set()
        entry["flags"] = run_flags(finished[arm], _hung(arm_base, arm, finished[arm]))
        # a person's notes for the agent (opalctl say): a human in the loop changes what the runs measure
        noted, entry["notes"] = notes_flag({s: arm_base / arm / f"seed-{s}" for s in finished[arm]})
        if noted is not None:
            entry["flags"].append(noted)
        if arm != baseline and (outside := outside_work_flag(finished[arm], finished[baseline])) is not None:
            entry["flags"].append(outside)
        for metric, higher in directions.items():
            mine = {s: v[metric] for s, v in values[arm].items() if v.get(metric) is not None}
            entry["metrics"][metric] = summary(mine.values(), what=f"the {stage} {metric} of arm {arm}")
            entry["values"][metric] = {str(s): mine[s] for s in sorted(mine)}
            if arm != baseline:
                theirs = {s: v[metric] for s, v in values[baseline].items() if v.get(metric) is not None}
                acted = {s: value for s, value in mine.items() if s not in left_out}
                figure = paired(theirs, acted, higher_is_better=higher, resamples=resamples,
                                what=f"{stage} {metric} (arm {arm}, baseline {baseline})")
                # an agent that never acted has no verdict to point at its controls from
                pointed = None if decided is not None and decided.instead_of_verdict else controls.get(arm)
                figure["verdict"] = verdict_pointer(verdict(arm, baseline, metric, figure, entry["flags"], decided),
                                                    pointed, entry["post_hoc"])
                entry["paired"][metric] = figure
        if primary is not None:
            entry["time_to_baseline"] = _time_to_baseline(finished[arm], finished[baseline], primary,
                                                          directions[primary], seconds_key)
        rows.append(entry)
    rule = TargetRule.of(lock)
    if rule is not None:  # each arm's time-to-target, from the evaluator's stage records and the lock (compare/target.py)
        amount = lock.resolved["budget"]["amount"]
        times = {arm: arm_times(rule, finished[arm], arm_budget(amount, arm_specs[arm])) for arm in arms}
        for entry in rows:
            arm = entry["arm"]
            entry["time_to_target"] = arm_figure(
                times[arm], None if arm == baseline else times[baseline], resamples=resamples,
                what=f"time-to-target (arm {arm}, baseline {baseline})")
    return {"lock": str(lock.path), "lock_sha256": lock.sha256, "runs": str(base), "baseline": baseline,
            "clock": clock, "seconds_key": seconds_key, "stage": stage,
            "target": None if rule is None else rule.to_json(),
            "metrics": {m: ("higher" if h else "lower") for m, h in directions.items()},
            "primary": primary, "arms": rows, "controls": list(controls.values()),
            "control_locks": [{"lock": str(c["lock"].path), "lock_sha256": c["lock"].sha256, "runs": str(c["base"])}
                              for c in post_hoc]}


def post_hoc_runs(lock, runs_dir: Path, stage: str | int) -> list[dict[str, Any]]:
    """The finished runs of every control lock of ``lock`` (``opalctl control``: beside it, naming its digest), each
    arm's values as compare reads them; a control lock without finished runs yet adds nothing."""
    out = []
    for control in control_locks(lock):
        try:
            base, finished, unfinished = collect(control, runs_dir)
        except BadInput:  # no runs of it yet
            continue
        values = {arm: {seed: _run_values(base / arm / f"seed-{seed}", report, stage)
                        for seed, report in finished[arm].items()} for arm in finished}
        out.append({"lock": control, "base": base, "finished": finished, "unfinished": unfinished,
                    "values": values, "arms": {arm: control.resolved["arms"][arm] for arm in control.resolved["arms"]}})
    return out


def _run_values(run_dir: Path, report: dict, stage: str | int) -> dict[str, Any]:
    """One run's value of every metric at ``stage``, with its final training loss."""
    try:
        loss = final_train_loss(run_dir)
    except ValueError:  # a report before the chain has no digest of its steps file: it is read, and may not decode
        raise RecordDamaged(f"{RunLayout.of(run_dir).steps} holds a line that is not JSON; the record is damaged "
                            f"(run the arm again)") from None
    return {**stage_metrics(report, stage, run_dir), TRAIN_LOSS: loss}


def _baseline(lock, baseline: str | None, arms: list[str], finished: dict[str, dict[int, dict]]) -> str:
    """The arm the others are paired against: the one asked for, or the first arm with finished runs."""
    if baseline is None:
        return arms[0]
    if baseline not in lock.resolved["arms"]:
        raise BadInput(f"--baseline {baseline!r} is not an arm of {lock.path} ({', '.join(lock.resolved['arms'])})")
    if baseline not in finished:
        raise BadInput(f"--baseline {baseline!r} has no finished runs yet; run it first")
    return baseline


def _arm_row(arm: str, baseline: str, finished: dict[str, dict[int, dict]],
             unfinished: dict[str, list[int]]) -> dict[str, Any]:
    """One arm's figures that need no metric; ``metrics``, ``paired`` and ``time_to_baseline`` are filled after."""
    reports = finished[arm]
    seeds = sorted(reports)
    return {
        "arm": arm,
        "baseline": arm == baseline,
        "seeds": seeds,
        "unfinished_seeds": sorted(unfinished.get(arm, [])),
        "updates": summary([reports[s]["updates"] for s in seeds]),
        "train_cpu_seconds": summary([reports[s]["seconds"]["train_cpu"] for s in seeds]),
        "train_wall_seconds": summary([reports[s]["seconds"]["train_wall"] for s in seeds]),
        "budget_used": summary([reports[s]["budget"]["used"] for s in seeds]),
        "promoted_stages": summary([len(reports[s]["promoted_stages"]) for s in seeds]),
        "selected_anchor": sum(1 for s in seeds if reports[s]["selected"]["source"] == "anchor"),
        "metrics": {},
        "values": {},  # metric -> {seed: value}, the seeds as strings (JSON object keys)
        "paired": {},
        "time_to_baseline": {},
        "time_to_target": None,  # filled where the protocol names a target (compare/target.py)
        "agent": _agent_figures(reports),
        "anchor_note": anchor_note(arm, [reports[s] for s in seeds]),
        # the kernel's count of the training process's CPU beyond its charged updates (compare/flags.py)
        "outside_cpu_seconds": summary([v for v in (outside_cpu(reports[s]) for s in seeds) if v is not None]),
        "unconfined_note": unconfined_note(arm, reports),
    }


def _time_to_baseline(reports: dict[int, dict], baseline_reports: dict[int, dict], primary: str, higher: bool,
                      seconds_key: str) -> dict[str, Any]:
    """How long the arm took, seed by seed, to reach the baseline's final value of the primary metric."""
    reached = []
    for seed in sorted(reports):
        if seed not in baseline_reports:
            continue
        target = baseline_reports[seed]["stages"][-1]["metrics"][primary]
        reached.append(time_to_reach(_curve(reports[seed], primary, seconds_key), target, higher_is_better=higher))
    hits = [r for r in reached if r is not None]
    return {"metric": primary, "seconds": summary(hits), "reached": len(hits), "of": len(reached)}


def _agent_figures(reports: dict[int, dict]) -> dict[str, Any] | None:
    agents = [r["agent"] for r in reports.values() if r.get("agent")]
    if not agents:
        return None
    figures = {key: summary([a.get(key, 0) or 0 for a in agents]) for key in AGENT_KEYS}
    # agent code's CPU seconds outside the timed updates: charged on the time clocks, only recorded on `updates`
    figures["code_outside_cpu_seconds"] = summary(
        [((a.get("agent_code_seconds") or {}).get("outside_updates") or {}).get("cpu", 0.0) for a in agents])
    return figures


def _hung(base: Path, arm: str, reports: dict[int, dict]) -> dict[int, int]:
    """seed -> the program versions that hung in that run (its ``hung.jsonl``, the agent optimizer's record)."""
    counted = {}
    for seed in reports:
        path = RunLayout(base / arm / f"seed-{seed}").hung
        try:
            counted[seed] = sum(1 for line in read_plain(path, EVENTS_MAX_BYTES).splitlines() if line.strip())
        except OSError:  # none hung (or the record is not a file that reads: a FIFO, a device)
            counted[seed] = 0
    return counted
