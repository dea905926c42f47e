"""``opalctl export LOCK --mlflow DIR``: each finished run of the lock as an MLflow run in a local store that
``mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db`` opens.

The store is MLflow's local database (``DIR/mlflow.db``, SQLite) with the runs' files in ``DIR/artifacts``: MLflow
3 refuses its older folder store (``file:DIR``) unless told otherwise and opens SQLite by default, so that is the
store written. One experiment per lock, named ``NAME-SHA12`` (the lock's runs folder); one run per arm and seed,
named ``ARM/seed-S``, with
- params: ``arm.*`` (the arm's settings) and ``protocol.*`` (the rest of the frozen protocol) flattened, lists and
  other values as compact JSON, and ``lock.*`` (name, file, sha256, protocol_sha256);
- tags: ``opalctl.lock_sha256``, ``opalctl.arm``, ``opalctl.seed`` (and ``mlflow.runName``);
- metrics, with the step the update: ``train/loss`` and ``train/lr/group-G`` at every update, ``anchor/METRIC`` at
  update 0, ``stage/METRIC`` and ``budget/used`` at each stage's update; each metric's timestamp is the run's start
  plus its training seconds at that update (the run's start and end times are set the same way);
- artifacts, for an agent arm: ``decisions.json`` (an MLflow table: decision, update, outcome, changed, summary,
  rationale, which the run page shows) and ``decisions.md``.

Nothing leaves the machine: the store is a local file, and MLflow's usage telemetry is turned off for the export
(``MLFLOW_DISABLE_TELEMETRY``); every ``MLFLOW_*`` variable of the user's is set aside while it runs, and MLflow's
log lines and warnings are kept off the terminal (stdout carries the command's report alone).

Exporting the same runs again replaces them: each arm and seed's new run is written whole, then the runs an
earlier export wrote for that arm and seed in the experiment (found by their tags) are deleted for good, with their
artifacts (as ``mlflow gc`` deletes a run), so the experiment holds one run per arm and seed; other runs and
experiments in the store are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from opalctl.errors import BadInput, OpalctlError
from opalctl.files import storage
from opalctl.trackers import (
    DECISION_COLUMNS,
    TrackedRun,
    decisions_markdown,
    environment,
    flattened,
    missing_package,
    stage_metric_name,
    tracked_runs,
)

DATABASE = "mlflow.db"
ARTIFACTS = "artifacts"
BATCH = 1000  # MLflow's most metrics in one log_batch call (and 100 params)
AGAIN = "run `opalctl export` again (or give --mlflow a folder that can be written)"


def store_uri(folder: str | Path) -> str:
    """The tracking URI of the store in ``folder``: what ``mlflow ui --backend-store-uri`` takes."""
    return f"sqlite:///{Path(folder).resolve() / DATABASE}"


def export_mlflow(lock_path: str | Path, folder: str | Path, *, runs_dir=None) -> dict[str, Any]:
    """Write the runs into the store; returns the experiment, each run's id, and the command that opens them."""
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise BadInput(f"--mlflow {target} is a file; give a folder for the MLflow store")
    lock, runs = tracked_runs(lock_path, runs_dir)  # every folder verified before anything is written
    with _quiet_mlflow() as client_class, storage(target, then=AGAIN), _refusals(target):
        target.mkdir(parents=True, exist_ok=True)
        uri = store_uri(target)
        client = client_class(tracking_uri=uri)
        experiment = _experiment(client, lock, target.resolve() / ARTIFACTS)
        with storage(target / ARTIFACTS, then=AGAIN):  # names a file where the runs' folder must be
            written = {run.name: _write_run(client, experiment, lock, run) for run in runs}
    return {"lock": str(lock.path), "mlflow": str(target), "tracking_uri": uri,
            "experiment": f"{lock.name}-{lock.sha12}", "experiment_id": experiment, "runs": written,
            "open": f"mlflow ui --backend-store-uri {uri}"}


@contextlib.contextmanager
def _quiet_mlflow() -> Iterator[Any]:
    """MlflowClient, with the user's MLflow environment set aside, telemetry off, and MLflow's log lines (the
    database's creation) and warnings kept off the terminal for the block."""
    with environment(("MLFLOW_",), {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise missing_package("--mlflow", "mlflow") from None
        loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]  # after the import, which sets them
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield MlflowClient
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)


@contextlib.contextmanager
def _refusals(target: Path) -> Iterator[None]:
    """MLflow's refusal (a store it cannot open or write) as one sentence naming the store."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except (MlflowException, SQLAlchemyError) as error:
        said = getattr(error, "orig", None) or getattr(error, "message", None) or error
        first = (str(said).strip().splitlines() or [type(error).__name__])[0]
        raise OpalctlError(f"MLflow refused the store {target / DATABASE} ({first}); give --mlflow a folder of its "
                           f"own, then {AGAIN}") from None


# the experiment's kind, as `mlflow ui`'s own selector ("Model training") sets it: without it the ui guesses, and may
# show the runs as a GenAI project's evaluations
KIND = ("mlflow.experimentKind", "custom_model_development")


def _experiment(client, lock, artifacts: Path) -> str:
    name = f"{lock.name}-{lock.sha12}"
    found = client.get_experiment_by_name(name)
    if found is not None:
        if found.lifecycle_stage != "active":
            client.restore_experiment(found.experiment_id)
        client.set_experiment_tag(found.experiment_id, *KIND)
        return found.experiment_id
    return client.create_experiment(name, artifact_location=artifacts.as_uri(), tags={
        "opalctl.lock_sha256": lock.sha256, "opalctl.lock": lock.path.name, KIND[0]: KIND[1]})


def _write_run(client, experiment: str, lock, run: TrackedRun) -> str:
    """One run, written whole before the runs an earlier export wrote for its arm and seed are deleted."""
    from mlflow.entities import ViewType

    earlier = [found.info.run_id for found in client.search_runs(
        [experiment], filter_string=f"tags.`opalctl.arm` = '{run.arm}' and tags.`opalctl.seed` = '{run.seed}'",
        run_view_type=ViewType.ALL)]
    started = round(run.started * 1000)
    created = client.create_run(experiment, start_time=started, run_name=run.name, tags={
        "opalctl.lock_sha256": lock.sha256, "opalctl.arm": run.arm, "opalctl.seed": str(run.seed)})
    run_id = created.info.run_id
    try:
        _log(client, run_id, run, started)
        client.set_terminated(run_id, end_time=started + round(run.seconds * 1000))
    except BaseException:
        _delete(client, run_id)
        raise
    for old in earlier:
        _delete(client, old)
    return run_id


def _log(client, run_id: str, run: TrackedRun, started: int) -> None:
    from mlflow.entities import Metric, Param

    config = run.config
    params = {**flattened(config["arm_settings"], "arm"), **flattened(config["protocol"], "protocol"),
              **flattened(config["lock"], "lock")}
    param_list = [Param(key, value) for key, value in params.items()]
    for index in range(0, len(param_list), 100):
        client.log_batch(run_id, params=param_list[index:index + 100])

    def at(seconds: float) -> int:
        return started + round(seconds * 1000)

    metrics = [Metric(f"anchor/{name}", float(value), started, 0) for name, value in run.anchor.items()]
    metrics += [Metric("train/loss", loss, at(seconds), update) for update, seconds, loss in run.loss]
    for group, points in run.learning_rates.items():
        metrics += [Metric(f"train/lr/group-{group}", rate, at(seconds), update) for update, seconds, rate in points]
    for update, seconds, values in run.stages:
        metrics += [Metric(stage_metric_name(name), float(value), at(seconds), update)
                    for name, value in values.items()]
    for index in range(0, len(metrics), BATCH):
        client.log_batch(run_id, metrics=metrics[index:index + BATCH])
    if config["arm_settings"].get("agent") is not None:
        columns = {column: [row[index] for row in run.decisions] for index, column in enumerate(DECISION_COLUMNS)}
        client.log_table(run_id, data=columns, artifact_file="decisions.json")
        client.log_text(run_id, decisions_markdown(run), "decisions.md")


def _delete(client, run_id: str) -> None:
    """A run deleted for good, its artifacts too, as ``mlflow gc`` deletes one (MLflow's delete_run only marks
    it deleted, and a second export must not leave the first one's runs in the store)."""
    artifact_uri = client.get_run(run_id).info.artifact_uri
    client.delete_run(run_id)
    store = client._tracking_client.store
    if hasattr(store, "_hard_delete_run"):  # what `mlflow gc` calls; absent, the run stays marked deleted
        store._hard_delete_run(run_id)
    if artifact_uri and artifact_uri.startswith("file:"):
        shutil.rmtree(Path(url2pathname(urlparse(artifact_uri).path)).parent, ignore_errors=True)

