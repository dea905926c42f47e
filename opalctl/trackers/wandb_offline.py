"""``opalctl export LOCK --wandb DIR``: each finished run of the lock as a Weights & Biases run in offline mode,
written under ``DIR/wandb/offline-run-*`` for ``wandb sync`` to upload later; nothing is sent over the network.

One W&B run per arm and seed: id ``SHA12-ARM-seed-S`` (so a later ``wandb sync`` of a second export lands on the
same run), name ``ARM/seed-S``, project the protocol's name, group ``NAME-SHA12`` (the lock's runs folder), job
type and tag the arm. Its config is ``trackers.TrackedRun.config`` (the frozen protocol, the arm's settings, the
lock's digest); its history, with the step the update: ``train/loss`` and ``train/lr/group-G`` at every update,
``anchor/METRIC`` at update 0, ``stage/METRIC`` and ``budget/used`` at each stage's update, and for an agent arm
the decisions as a ``wandb.Table`` ``agent/decisions`` (decision, update, outcome, changed, summary, rationale) at
the last update. Each history row's ``_timestamp`` is the run's start plus its training seconds at that update.

W&B is kept to DIR: the user's W&B environment (every ``WANDB_*`` variable: mode, project, key) is set aside for
the export and put back after it, the offline mode is set here, W&B's settings and cache folders are a temporary
folder removed after the export (so the user's ``~/.config/wandb`` and ``~/.cache/wandb`` are neither read nor
written), and the tables W&B stages for upload lie in ``DIR/wandb-staging/<run id>/`` (``wandb sync`` reads them).
W&B prints nothing (silent, console capture off): stdout carries the command's report alone.

Exporting the same runs again replaces them: each run's new folder is written whole first, then the earlier
export's folders of that run id (``DIR/wandb/offline-run-*-<id>``) and its staged tables are removed; nothing
else in DIR is touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput, OpalctlError
from opalctl.files import storage
from opalctl.trackers import DECISION_COLUMNS, TrackedRun, environment, missing_package, stage_metric_name, tracked_runs

STAGING = "wandb-staging"
AGAIN = "run `opalctl export` again (or give --wandb a folder that can be written)"


def export_wandb(lock_path: str | Path, folder: str | Path, *, runs_dir=None) -> dict[str, Any]:
    """Write the offline runs; returns their folders, one per run, and the command that uploads them."""
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise BadInput(f"--wandb {target} is a file; give a folder for the offline W&B runs")
    lock, runs = tracked_runs(lock_path, runs_dir)  # every folder verified before anything is written
    written = []
    with IsolatedWandb() as wandb, storage(target, then=AGAIN):
        target.mkdir(parents=True, exist_ok=True)
        target = target.resolve()
        with storage(target / "wandb", then=AGAIN):  # names a file where W&B's folder must be
            for run in runs:
                written.append(str(_write_run(wandb, lock, run, target)))
    return {"lock": str(lock.path), "wandb": str(target), "runs": written,
            "upload": f"wandb sync {target / 'wandb'}/offline-run-*"}


def run_id(lock, run: TrackedRun) -> str:
    return f"{lock.sha12}-{run.arm}-seed-{run.seed}"


class IsolatedWandb:
    """The wandb module with the user's W&B environment set aside and W&B's own folders in a temporary one, for
    the length of the block; W&B's service is stopped when the block ends."""

    def __enter__(self):
        self._scratch = tempfile.TemporaryDirectory(prefix="opalctl-wandb-")
        scratch = Path(self._scratch.name)
        self._environment = environment(("WANDB_",), {
            "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_ERROR_REPORTING": "false",
            "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB_CONFIG_DIR": str(scratch / "config"),
            "WANDB_CACHE_DIR": str(scratch / "cache"), "WANDB_DATA_DIR": str(scratch / "data"),
            "WANDB_ARTIFACT_DIR": str(scratch / "artifacts")})
        self._environment.__enter__()
        try:
            import wandb
        except ImportError:
            self._leave()
            raise missing_package("--wandb", "wandb") from None
        self.wandb = wandb
        return wandb

    def __exit__(self, *exc_info) -> None:
        try:
            self.wandb.teardown()
        finally:
            self._leave()

    def _leave(self) -> None:
        self._environment.__exit__(None, None, None)
        self._scratch.cleanup()


def _write_run(wandb, lock, run: TrackedRun, target: Path) -> Path:
    """One offline run, written whole before the earlier export's folders of its id are removed."""
    identity = run_id(lock, run)
    staging = target / STAGING / identity
    staging.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=staging))
    os.environ["WANDB_DATA_DIR"] = str(staged)  # where wandb.Table's file waits for `wandb sync`
    earlier = set((target / "wandb").glob(f"offline-run-*-{identity}"))
    settings = wandb.Settings(
        mode="offline", silent=True, quiet=True, console="off", show_info=False, show_warnings=False,
        show_errors=False, x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True, disable_git=True,
        disable_code=True, save_code=False, disable_job_creation=True, root_dir=str(target))
    written: Path | None = None
    try:
        tracked = wandb.init(dir=str(target), project=lock.name, id=identity, name=run.name,
                             group=f"{lock.name}-{lock.sha12}", job_type=run.arm, tags=[run.arm], config=run.config,
                             settings=settings, reinit="create_new", resume="never")
        written = Path(tracked.settings.sync_dir)
        try:
            _log(wandb, tracked, run)
        finally:
            tracked.finish()
    except BaseException as error:
        if written is not None and written not in earlier:
            shutil.rmtree(written, ignore_errors=True)
        shutil.rmtree(staged, ignore_errors=True)
        for empty in (staging, staging.parent):
            with contextlib.suppress(OSError):
                empty.rmdir()
        if isinstance(error, wandb.Error):  # W&B's refusal (its service could not start or write): one sentence
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise OpalctlError(f"W&B could not write the offline run {run.name} in {target} ({first}); "
                               f"{AGAIN}") from None
        raise
    for path in earlier - {written}:
        shutil.rmtree(path, ignore_errors=True)
    for path in set(staging.iterdir()) - {staged}:
        shutil.rmtree(path, ignore_errors=True)
    for empty in (staged, staging, staging.parent):  # a run without a table stages nothing
        with contextlib.suppress(OSError):
            empty.rmdir()
    return written


def _log(wandb, tracked, run: TrackedRun) -> None:
    """The history, one row per update in order (W&B's step only goes up)."""
    started = run.started
    rows: dict[int, dict[str, Any]] = {0: {f"anchor/{metric}": value for metric, value in run.anchor.items()}}
    seconds = {0: 0.0}
    for update, at, loss in run.loss:
        rows.setdefault(update, {})["train/loss"] = loss
        seconds[update] = at
    for group, points in run.learning_rates.items():
        for update, at, rate in points:
            rows.setdefault(update, {})[f"train/lr/group-{group}"] = rate
            seconds.setdefault(update, at)
    for update, at, metrics in run.stages:
        rows.setdefault(update, {}).update({stage_metric_name(name): value for name, value in metrics.items()})
        seconds.setdefault(update, at)
    last = max(rows)
    if run.config["arm_settings"].get("agent") is not None:
        rows[last]["agent/decisions"] = wandb.Table(columns=list(DECISION_COLUMNS), data=run.decisions)
    for update in sorted(rows):
        if rows[update]:
            tracked.log({**rows[update], "_timestamp": started + seconds.get(update, 0.0)}, step=update)

