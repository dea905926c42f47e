"""What ``opalctl export LOCK --wandb DIR`` and ``--mlflow DIR`` send to an experiment tracker: one tracked run
per finished run of the lock (arm and seed), read here once for both trackers (``wandb_offline``,
``mlflow_store``).

A tracked run holds the training loss at every update and the learning rate of each parameter group at every
update (from the steps records; a run recorded before opalctl kept the rates has none), the stage metrics at each
stage's update, the anchor's metrics, the budget used at each stage, and the agent's decisions as rows of a table,
with the frozen protocol (the lock's resolved protocol without the other arms, and this arm's settings) and the
lock's digest as its configuration. The names are TensorBoard's export's: ``train/loss``, ``train/lr/group-G``,
``stage/METRIC``, ``anchor/METRIC``, ``budget/used``, ``agent/decisions``.

The folders were checked before (``export.verified_runs``: every run folder's chain of digests, before any tracker
writes), so a folder that does not verify is refused in ``show``'s sentence and exit code with nothing written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opalctl.driver.records import read_steps
from opalctl.driver.show import agent_decisions
from opalctl.errors import OpalctlError
from opalctl.export import verified_runs
from opalctl.formats import StartRecord, read_record
from opalctl.layout import RunLayout
from opalctl.report.runs import loss_curve

DECISION_COLUMNS = ("decision", "update", "outcome", "changed", "summary", "rationale")


@dataclass
class TrackedRun:
    """One run as a tracker receives it (``tracked_runs``)."""

    arm: str
    seed: int
    folder: Path
    started_at: str | None  # the run's start (UTC, ISO 8601), as start.json has it
    config: dict[str, Any]
    loss: list[tuple[int, float, float]] = field(default_factory=list)  # (update, training seconds, loss)
    learning_rates: dict[int, list[tuple[int, float, float]]] = field(default_factory=dict)  # group -> points
    stages: list[tuple[int, float, dict[str, float]]] = field(default_factory=list)  # (update, seconds, metrics)
    anchor: dict[str, float] = field(default_factory=dict)
    decisions: list[list[Any]] = field(default_factory=list)  # rows in DECISION_COLUMNS order

    @property
    def name(self) -> str:
        """The name both trackers show, as TensorBoard's export names its folder: ``ARM/seed-S``."""
        return f"{self.arm}/seed-{self.seed}"

    @property
    def started(self) -> float:
        """The run's start in seconds since the epoch (0 when start.json does not say)."""
        if not self.started_at:
            return 0.0
        try:
            return dt.datetime.fromisoformat(self.started_at.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return 0.0

    @property
    def seconds(self) -> float:
        """The run's training seconds at its last update."""
        return self.loss[-1][1] if self.loss else 0.0


def tracked_runs(lock_path: str | Path, runs_dir=None) -> tuple[Any, list[TrackedRun]]:
    """The lock and each of its finished runs read for a tracker, every folder verified before any is read."""
    lock, runs = verified_runs(lock_path, runs_dir)
    return lock, [_tracked(lock, run) for run in runs]


def _tracked(lock, run) -> TrackedRun:
    layout = RunLayout.of(run.folder)
    start = read_record(layout.start, StartRecord)
    protocol = {key: value for key, value in lock.resolved.items() if key != "arms"}
    tracked = TrackedRun(run.arm, run.seed, run.folder, start.started_at, config={
        "arm": run.arm, "seed": run.seed, "arm_settings": lock.resolved["arms"][run.arm], "protocol": protocol,
        "lock": {"name": lock.name, "file": lock.path.name, "sha256": lock.sha256,
                 "protocol_sha256": lock.data["protocol_sha256"]}})
    curve = loss_curve(run.folder, every_update=True)
    tracked.loss = list(zip(curve.updates, curve.seconds, curve.losses, strict=True))
    for update, group, rate in learning_rates(layout.steps):
        tracked.learning_rates.setdefault(group, []).append((update, curve.seconds_at(update) or 0.0, rate))
    for stage in run.report["stages"]:
        metrics = {name: value for name, value in stage["metrics"].items() if value is not None}  # None: not finite
        if "budget_used" in stage:
            metrics["budget/used"] = stage["budget_used"]
        tracked.stages.append((stage["update"], curve.seconds_at(stage["update"]) or 0.0, metrics))
    tracked.anchor = dict(run.report["anchor_metrics"])
    for decision in agent_decisions(layout.events, layout.decisions) or []:
        update = decision.get("answered_at")
        tracked.decisions.append([
            decision["decision"], decision["asked_at"] if update is None else update, decision["outcome"],
            ", ".join(decision.get("files") or []), decision.get("summary") or "",
            decision.get("rationale") or decision.get("message") or ""])
    return tracked


def learning_rates(steps: Path) -> Iterator[tuple[int, int, float]]:
    """Each (update, parameter group, learning rate) of a steps file's ``lrs``: none from a line without them (an
    opalctl older than the field, or an update that stepped no torch optimizer: null), none for a group whose value
    is no finite number."""
    if not steps.is_file():
        return
    for line in read_steps(steps):
        rates = line.get("lrs")
        for group, rate in enumerate(rates if isinstance(rates, list) else []):
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate - rate == 0:
                yield line["update"], group, float(rate)


def stage_metric_name(metric: str) -> str:
    """A stage record's metric under the trackers' name: the budget used keeps its own, the others go under stage/."""
    return metric if metric == "budget/used" else f"stage/{metric}"


def flattened(value: Any, prefix: str = "") -> dict[str, str]:
    """A nested mapping as ``a.b.c`` keys to text: mappings opened, anything else (lists too) as compact JSON."""
    if isinstance(value, dict) and value:
        flat: dict[str, str] = {}
        for key in sorted(value):
            flat.update(flattened(value[key], f"{prefix}.{key}" if prefix else str(key)))
        return flat
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))
    return {prefix: text}


def decisions_markdown(run: TrackedRun) -> str:
    """The decisions as a markdown table (the MLflow artifact ``decisions.md``)."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = [f"# Agent decisions of {run.name}", "", "| " + " | ".join(DECISION_COLUMNS) + " |",
             "|" + "---|" * len(DECISION_COLUMNS)]
    lines.extend("| " + " | ".join(cell(value) for value in row) + " |" for row in run.decisions)
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def environment(removed_prefixes: tuple[str, ...], set_to: dict[str, str]) -> Iterator[None]:
    """The process's environment without the variables starting with one of ``removed_prefixes`` and with
    ``set_to``, put back as it was when the block ends: a tracker reads its settings from the environment, and
    the export must neither follow the user's (their mode, project, key) nor leave its own behind."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(removed_prefixes):
            del os.environ[name]
    os.environ.update(set_to)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def missing_package(flag: str, extra: str) -> OpalctlError:
    return OpalctlError(f"opalctl export {flag} needs the {extra} package, which is not installed; install it with "
                        f"`pip install 'opalctl[{extra}]'`")
