"""``opalctl export LOCK --tensorboard DIR``: every finished run of a lock as TensorBoard event files, so people
who live in TensorBoard see the runs there.

One folder per run (``DIR/<arm>/seed-<S>``, the name TensorBoard shows), holding: ``train/loss`` at every update
(from the steps records), ``train/lr/group-<G>`` at every update, the effective learning rate of parameter group G
as that update's step used it (from the same records; none for a run recorded before opalctl kept it),
``stage/<metric>`` at each stage's update and ``anchor/<metric>`` at update 0 (from the report), ``budget/used`` at
each stage, and each agent decision as text under ``agent/decisions`` (stored as ``agent/decisions/text_summary``)
at the update it was answered. Every event's wall time is the run's training seconds at that update (the steps
records' axis), not the moment of the export, so TensorBoard's "relative" axis reads training seconds and
exporting the same runs twice writes the same events. An export replaces the event files an earlier export
left in a run's folder (TensorBoard would show both), and touches nothing else there.

Every run folder is read and its chain of digests checked first, as ``opalctl show`` checks it
(``verify.folder.checked_run_folder``): an edited or damaged folder is refused in show's sentence and exit code
(3 for a record that no longer matches, 1 for one that cannot be read) before any event file is written, so an
export never shows what ``show`` would not.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.driver.show import agent_decisions
from opalctl.errors import BadInput, OpalctlError
from opalctl.files import storage
from opalctl.layout import RunLayout, runs_dir_default
from opalctl.protocol.lock import read_lock
from opalctl.report.runs import loss_curve
from opalctl.verify.folder import checked_run_folder


@dataclass(frozen=True)
class FinishedRun:
    """One finished run of a lock, its folder's chain of digests checked: what every export writes out."""

    arm: str
    seed: int
    folder: Path
    report: dict[str, Any]


def verified_runs(lock_path: str | Path, runs_dir=None) -> tuple[Any, list[FinishedRun]]:
    """The lock and its finished runs (by arm, then seed), every folder checked as ``show`` checks it, so a caller
    that writes only after this returns writes nothing when one folder does not verify."""
    from opalctl.compare.aggregate import collect

    lock = read_lock(Path(lock_path))
    base, finished, _unfinished = collect(lock, runs_dir_default(runs_dir))
    runs = [FinishedRun(arm, seed, base / arm / f"seed-{seed}", finished[arm][seed])
            for arm in finished for seed in sorted(finished[arm])]
    for run in runs:
        checked_run_folder(run.folder)
    return lock, runs


def export_tensorboard(lock_path: str | Path, folder: str | Path, *, runs_dir=None) -> dict[str, Any]:
    """Write the event files; returns the folders written, one per run."""
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise BadInput(f"--tensorboard {target} is a file; give a folder for the event files")
    lock, runs = verified_runs(lock_path, runs_dir)  # every folder checked before any event file is written
    written = []
    for run in runs:
        run_folder = target / run.arm / f"seed-{run.seed}"
        _write_run(run.folder, run.report, run_folder)
        written.append(str(run_folder))
    return {"lock": str(lock.path), "tensorboard": str(target), "runs": written}


def _summary_writer():
    """torch's ``SummaryWriter``, which needs the tensorboard package (an optional dependency of opalctl)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise OpalctlError("opalctl export --tensorboard needs the tensorboard package, which is not installed; "
                           "install it with `pip install tensorboard`") from None
    return SummaryWriter


def _write_run(run_dir: Path, report: dict[str, Any], folder: Path) -> None:
    """The run's event files in ``folder``: the new file is written whole before the earlier export's files are
    removed, so a write the storage refuses leaves the earlier export as it was (and no part of the new one)."""
    earlier = set(folder.glob("events.out.tfevents.*"))
    with storage(folder, then="run `opalctl export` again (or give --tensorboard a folder that can be written)"):
        try:
            _write_events(run_dir, report, folder)
        except BaseException:
            for written in set(folder.glob("events.out.tfevents.*")) - earlier:
                written.unlink(missing_ok=True)
            raise
        for path in earlier:
            path.unlink(missing_ok=True)


def _write_events(run_dir: Path, report: dict[str, Any], folder: Path) -> None:
    curve = loss_curve(run_dir, every_update=True)
    with _writer_thread_failures() as failures:
        writer = _summary_writer()(log_dir=str(folder))
        try:
            _add_events(writer, run_dir, report, curve)
        finally:
            writer.close()
    if failures:  # the last writes failed in the writer's thread, after the calls that would have said so
        raise failures[0]


@contextlib.contextmanager
def _writer_thread_failures() -> Iterator[list[OSError]]:
    """The OSErrors of the event writer's own thread, kept (and not printed as a thread's traceback) while the
    block runs: TensorBoard's writer writes in a thread of its own, which re-raises the error for a later call
    to find, but one that happens at its last write is found by no call."""
    failures: list[OSError] = []
    previous = threading.excepthook

    def keep(args) -> None:
        if isinstance(args.exc_value, OSError):
            failures.append(args.exc_value)
        else:
            previous(args)

    threading.excepthook = keep
    try:
        yield failures
    finally:
        threading.excepthook = previous


def _add_events(writer, run_dir: Path, report: dict[str, Any], curve) -> None:
    for update, seconds, loss, lrs in zip(curve.updates, curve.seconds, curve.losses, curve.lrs, strict=True):
        writer.add_scalar("train/loss", loss, update, walltime=seconds)
        for group, lr in enumerate(lrs or []):
            if lr is not None:
                writer.add_scalar(f"train/lr/group-{group}", lr, update, walltime=seconds)
    for metric, value in report["anchor_metrics"].items():
        writer.add_scalar(f"anchor/{metric}", value, 0, walltime=0.0)
    for stage in report["stages"]:
        seconds = curve.seconds_at(stage["update"]) or 0.0
        for metric, value in stage["metrics"].items():
            if value is None:  # not finite (a diverged model's): no point of the curve
                continue
            writer.add_scalar(f"stage/{metric}", value, stage["update"], walltime=seconds)
        if "budget_used" in stage:
            writer.add_scalar("budget/used", stage["budget_used"], stage["update"], walltime=seconds)
    layout = RunLayout.of(run_dir)
    for decision in agent_decisions(layout.events, layout.decisions) or []:
        if decision.get("answered_at") is None:
            continue
        writer.add_text("agent/decisions", decision_text(decision), decision["answered_at"],
                        walltime=curve.seconds_at(decision["answered_at"]) or 0.0)


def decision_text(decision: dict[str, Any]) -> str:
    """A decision as TensorBoard's text plugin shows it (markdown): number, outcome, summary, rationale."""
    lines = [f"**decision {decision['decision']}**: {decision['outcome']} (asked at update {decision['asked_at']}, "
             f"{decision.get('reason')})"]
    if decision.get("reverted_at") is not None:
        lines.append(f"reverted at update {decision['reverted_at']}: {decision.get('revert_reason') or ''}")
    lines.extend(text for text in (decision.get("summary"), decision.get("rationale"), decision.get("message"))
                 if text)
    return "\n\n".join(lines)
