"""``opalctl export LOCK --wandb DIR`` and ``--mlflow DIR``, read back with the real packages: W&B's offline run
file (its records, as ``wandb.proto`` defines them) and MLflow's own client on the store."""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import os
import shutil
import socket
import struct
import sys
import zlib
from pathlib import Path

import pytest

from tests.support.cli import call_cli, run_cli

wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install 'opalctl[wandb]')")
mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'opalctl[mlflow]')")


# -- reading back ------------------------------------------------------------------------------------------------

def _wandb_records(path: Path):
    """Each record of an offline run's ``.wandb`` file: W&B's transaction log (a 7-byte header ``:W&B``, magic
    0xBEE1, version 0, then 32 KiB blocks of chunks, each with a CRC-32 of its type and data, a length and a type:
    full, first, middle, last), every chunk's checksum checked, decoded as ``wandb_internal_pb2.Record``. W&B 0.31
    has no Python reader of its own (its Go core reads the file for ``wandb sync``)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    position, block, pieces = 7, 32768, []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if (checksum, length, kind) == (0, 0, 0):  # the rest of a block that no chunk filled
            position += left
            continue
        chunk = data[position + 7:position + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"{path}: a damaged chunk at {position}"
        position += 7 + length
        pieces.append(chunk)
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


class OfflineRun:
    """What an offline run folder holds: the run record, the config, the history rows by step, the files."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.history: dict[int, dict] = {}
        for record in _wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self.config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                row: dict = {}
                for item in record.history.item:  # a logged object's fields come one by one, under nested keys
                    *within, key = [item.key] if item.key else list(item.nested_key)
                    place = row
                    for name in within:
                        place = place.setdefault(name, {})
                    place[key] = json.loads(item.value_json)
                self.history[row["_step"]] = row

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, row[key]) for step, row in sorted(self.history.items()) if key in row]


def _steps(run_dir: Path) -> list[dict]:
    with gzip.open(run_dir / "training" / "steps.jsonl.gz", "rt") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _outcomes(run_dir: Path) -> list[dict]:
    path = run_dir / "training" / "opal" / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [event for event in events if event.get("kind") in ("applied", "kept")]


def _run_dirs(grid) -> dict[str, Path]:
    return {f"{arm.name}/{seed.name}": seed for arm in sorted(grid["base"].iterdir()) if arm.name != "anchors"
            for seed in sorted(arm.glob("seed-*"))}


def _lock(grid) -> dict:
    return json.loads(Path(grid["lock"]).read_text())


# -- W&B ---------------------------------------------------------------------------------------------------------

def _export(grid, flag, folder, *extra, runner=call_cli):
    return runner("export", grid["lock"], "--runs-dir", grid["runs"], flag, folder, *extra)


@pytest.fixture(scope="module")
def user_wandb(tmp_path_factory):
    """The user's own W&B settings: folders of theirs, online mode, a key, a project, and a W&B server on loopback
    that counts the connections it is offered (an export must make none), set for the module's exports."""
    home = tmp_path_factory.mktemp("user-wandb")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    settings = {"WANDB_MODE": "online", "WANDB_API_KEY": "x" * 40, "WANDB_CONFIG_DIR": str(home / "config"),
                "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
                "WANDB_DIR": str(home / "dir"), "WANDB_PROJECT": "theirs",
                "WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}"}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in settings.items():
            patch.setenv(name, value)
        yield {"home": home, "server": server, "settings": settings}
    server.close()


@pytest.fixture(scope="module")
def wandb_export(grid, tmp_path_factory, user_wandb):
    folder = tmp_path_factory.mktemp("wandb-export") / "tracked"
    result = _export(grid, "--wandb", folder, "--json")
    assert result.code == 0, result.stderr
    return {"folder": folder, "result": result}


def test_the_wandb_export_holds_each_runs_config_loss_stages_and_decisions(grid, wandb_export):
    result = wandb_export["result"]
    reported = json.loads(result.stdout)  # the whole of stdout is one JSON document: W&B printed nothing there
    assert result.stderr == ""
    lock = _lock(grid)
    sha12 = Path(grid["base"]).name.rsplit("-", 1)[1]
    run_dirs = _run_dirs(grid)
    folders = {OfflineRun(Path(folder)).run.display_name: Path(folder) for folder in reported["runs"]}
    assert sorted(folders) == sorted(run_dirs)
    assert sorted(p.name for p in (wandb_export["folder"] / "wandb").glob("offline-run-*")) == \
        sorted(folder.name for folder in folders.values())
    assert reported["upload"] == f"wandb sync {wandb_export['folder'].resolve() / 'wandb'}/offline-run-*"
    for name, run_dir in run_dirs.items():
        arm, seed = name.split("/seed-")
        offline = OfflineRun(folders[name])
        assert (offline.run.run_id, offline.run.project, offline.run.run_group, offline.run.job_type,
                list(offline.run.tags)) == (f"{sha12}-{arm}-seed-{seed}", lock["name"], f"{lock['name']}-{sha12}",
                                            arm, [arm])
        assert offline.config["arm_settings"] == lock["protocol"]["arms"][arm]
        assert offline.config["protocol"] == {k: v for k, v in lock["protocol"].items() if k != "arms"}
        assert offline.config["lock"]["sha256"] == hashlib.sha256(Path(grid["lock"]).read_bytes()).hexdigest()
        assert offline.config["lock"]["protocol_sha256"] == lock["protocol_sha256"]
        steps = _steps(run_dir)
        assert offline.series("train/loss") == [(s["update"], pytest.approx(s["loss"], rel=1e-12)) for s in steps]
        groups = max((len(s.get("lrs") or []) for s in steps), default=0)  # none before the steps kept them
        for group in range(groups):
            assert offline.series(f"train/lr/group-{group}") == [
                (s["update"], pytest.approx(s["lrs"][group], rel=1e-12)) for s in steps if s.get("lrs")]
        exported_groups = {key for row in offline.history.values() for key in row if key.startswith("train/lr/")}
        assert exported_groups == {f"train/lr/group-{group}" for group in range(groups)}
        report = json.loads((run_dir / "report.json").read_text())
        for metric in ("selection.correct", "retention.loss"):
            assert offline.series(f"stage/{metric}") == \
                [(s["update"], pytest.approx(s["metrics"][metric], rel=1e-12)) for s in report["stages"]]
            assert offline.history[0][f"anchor/{metric}"] == pytest.approx(report["anchor_metrics"][metric])
        assert offline.series("budget/used") == [(s["update"], s["budget_used"]) for s in report["stages"]]
        started = json.loads((run_dir / "start.json").read_text())["started_at"]
        first = offline.history[steps[0]["update"]]["_timestamp"]
        assert first == pytest.approx(dt.datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
                                      + steps[0]["wall"], abs=1e-3), "the run's start plus its training seconds"
        tables = [row["agent/decisions"] for row in offline.history.values() if "agent/decisions" in row]
        if lock["protocol"]["arms"][arm]["agent"] is None:
            assert tables == []
            continue
        assert len(tables) == 1 and tables[0]["_type"] == "table-file"
        table = json.loads((folders[name] / "files" / tables[0]["path"]).read_text())
        assert table["columns"] == ["decision", "update", "outcome", "changed", "summary", "rationale"]
        answered = [row for row in table["data"] if row[2] in ("applied", "kept")]
        outcomes = _outcomes(run_dir)
        assert outcomes, "the agent arm decided nothing: the table would test nothing"
        assert [(row[0], row[1], row[2]) for row in answered] == \
            [(e["decision"], e["update"], e["kind"]) for e in outcomes]
        assert [row[4] for row in answered] == [e.get("summary", "") for e in outcomes]


def test_the_wandb_export_keeps_to_its_folder_and_sends_nothing(wandb_export, user_wandb):
    home, server = user_wandb["home"], user_wandb["server"]
    with pytest.raises(BlockingIOError):
        server.accept()  # no connection was offered to the W&B server the user's settings name
    assert not any(home.rglob("*")), "the user's W&B folders were written"
    assert {name: os.environ.get(name) for name in user_wandb["settings"]} == user_wandb["settings"], \
        "the user's W&B environment was not put back"
    assert sorted(p.name for p in wandb_export["folder"].iterdir()) == ["wandb", "wandb-staging"]


def _content(folder: Path) -> tuple:
    """An offline run as a later upload would show it: its run record's names, config and history (without
    ``_runtime``, the seconds this export's process took)."""
    run = OfflineRun(folder)
    history = {step: {k: v for k, v in row.items() if k != "_runtime"} for step, row in run.history.items()}
    for row in history.values():
        if "agent/decisions" in row:  # the table's file stays; W&B names its upload with a new client id each time
            row["agent/decisions"] = {k: v for k, v in row["agent/decisions"].items()
                                      if k not in ("artifact_path", "_latest_artifact_path")}
    return (run.run.run_id, run.run.display_name, run.run.run_group, run.config, history)


def test_exporting_to_wandb_again_replaces_each_run(grid, tmp_path):
    folder = tmp_path / "tracked"
    first = json.loads(_export(grid, "--wandb", folder, "--json").stdout)
    before = [_content(Path(path)) for path in first["runs"]]
    (folder / "notes.txt").write_text("mine")
    second = _export(grid, "--wandb", folder, "--json", runner=run_cli)  # a process of its own: W&B's service writes nothing
    assert (second.code, second.stderr) == (0, ""), second.stderr  # on the terminal's descriptors either
    again = json.loads(second.stdout)
    assert sorted(p.name for p in (folder / "wandb").glob("offline-run-*")) == \
        sorted(Path(path).name for path in again["runs"]), "one folder per run: the earlier export's were removed"
    assert (folder / "notes.txt").read_text() == "mine"
    assert [_content(Path(path)) for path in again["runs"]] == before
    for staged in (folder / "wandb-staging").iterdir():
        assert len(list(staged.iterdir())) == 1, "the earlier export's staged tables were left"


# -- MLflow ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_export(grid, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow-export") / "store"
    result = _export(grid, "--mlflow", folder, "--json")
    assert result.code == 0, result.stderr
    return {"folder": folder, "result": result}


def _mlflow_runs(uri: str, experiment_name: str):
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
    return client, experiment, runs


def test_the_mlflow_export_holds_each_runs_params_tags_metrics_and_decisions(grid, mlflow_export):
    result = mlflow_export["result"]
    reported = json.loads(result.stdout)
    assert result.stderr == "", "MLflow's log lines reached the terminal"
    lock = _lock(grid)
    sha256 = hashlib.sha256(Path(grid["lock"]).read_bytes()).hexdigest()
    uri = f"sqlite:///{mlflow_export['folder'].resolve() / 'mlflow.db'}"
    assert (reported["tracking_uri"], reported["open"]) == (uri, f"mlflow ui --backend-store-uri {uri}")
    client, experiment, runs = _mlflow_runs(uri, f"{lock['name']}-{sha256[:12]}")
    run_dirs = _run_dirs(grid)
    by_name = {run.info.run_name: run for run in runs}
    assert sorted(by_name) == sorted(run_dirs) and len(runs) == len(run_dirs)
    assert all(run.info.lifecycle_stage == "active" and run.info.status == "FINISHED" for run in runs)
    assert {name: run.info.run_id for name, run in by_name.items()} == reported["runs"]
    for name, run_dir in run_dirs.items():
        arm, seed = name.split("/seed-")
        run = by_name[name]
        assert {k: v for k, v in run.data.tags.items() if k.startswith("opalctl.")} == \
            {"opalctl.lock_sha256": sha256, "opalctl.arm": arm, "opalctl.seed": seed}
        params = run.data.params
        settings = lock["protocol"]["arms"][arm]
        assert params["arm.optimizer.lr"] == json.dumps(settings["optimizer"]["lr"])
        assert params["arm.optimizer.name"] == settings["optimizer"]["name"]
        assert params["protocol.budget.clock"] == lock["protocol"]["budget"]["clock"]
        assert params["protocol.budget.fractions"] == json.dumps(lock["protocol"]["budget"]["fractions"],
                                                                 separators=(",", ":"))
        assert params["lock.sha256"] == sha256
        steps = _steps(run_dir)
        loss = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted((m.step, m.value) for m in loss) == \
            [(s["update"], pytest.approx(s["loss"], rel=1e-12)) for s in steps]
        groups = max((len(s.get("lrs") or []) for s in steps), default=0)
        for group in range(groups):
            history = client.get_metric_history(run.info.run_id, f"train/lr/group-{group}")
            assert sorted((m.step, m.value) for m in history) == \
                [(s["update"], pytest.approx(s["lrs"][group], rel=1e-12)) for s in steps if s.get("lrs")]
        assert {key for key in run.data.metrics if key.startswith("train/lr/")} == \
            {f"train/lr/group-{group}" for group in range(groups)}
        report = json.loads((run_dir / "report.json").read_text())
        for metric in ("selection.correct", "retention.loss"):
            history = client.get_metric_history(run.info.run_id, f"stage/{metric}")
            assert sorted((m.step, m.value) for m in history) == \
                [(s["update"], pytest.approx(s["metrics"][metric], rel=1e-12)) for s in report["stages"]]
            anchor = client.get_metric_history(run.info.run_id, f"anchor/{metric}")
            assert [(m.step, m.value) for m in anchor] == [(0, pytest.approx(report["anchor_metrics"][metric]))]
        started = json.loads((run_dir / "start.json").read_text())["started_at"]
        assert run.info.start_time == round(dt.datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
                                            * 1000)
        artifacts = sorted(entry.path for entry in client.list_artifacts(run.info.run_id))
        if settings["agent"] is None:
            assert artifacts == []
            continue
        assert artifacts == ["decisions.json", "decisions.md"]
        table = json.loads(Path(client.download_artifacts(run.info.run_id, "decisions.json",
                                                          str(mlflow_export["folder"].parent))).read_text())
        assert table["columns"] == ["decision", "update", "outcome", "changed", "summary", "rationale"]
        outcomes = _outcomes(run_dir)
        assert outcomes, "the agent arm decided nothing: the table would test nothing"
        answered = [row for row in table["data"] if row[2] in ("applied", "kept")]
        assert [(row[0], row[1], row[2], row[4]) for row in answered] == \
            [(e["decision"], e["update"], e["kind"], e.get("summary", "")) for e in outcomes]


def _store_content(uri: str, experiment_name: str) -> dict:
    client, _experiment, runs = _mlflow_runs(uri, experiment_name)
    return {run.info.run_name: (run.info.lifecycle_stage, run.info.start_time, run.info.end_time, run.data.params,
                                run.data.tags.get("opalctl.arm"),
                                sorted((m.step, m.timestamp, m.value) for m in
                                       client.get_metric_history(run.info.run_id, "train/loss")),
                                sorted(e.path for e in client.list_artifacts(run.info.run_id)))
            for run in runs}


def test_exporting_to_mlflow_again_replaces_each_run(grid, tmp_path):
    folder = tmp_path / "store"
    first = json.loads(_export(grid, "--mlflow", folder, "--json").stdout)
    before = _store_content(first["tracking_uri"], first["experiment"])
    second = _export(grid, "--mlflow", folder, "--json", runner=run_cli)  # a process of its own, as a user runs it
    assert (second.code, second.stderr) == (0, ""), second.stderr
    again = json.loads(second.stdout)
    assert _store_content(again["tracking_uri"], again["experiment"]) == before, \
        "one run per arm and seed, as the first export wrote it (the earlier runs deleted, not kept as deleted)"
    assert set(first["runs"].values()).isdisjoint(again["runs"].values())
    assert sorted(p.name for p in (folder / "artifacts").iterdir()) == \
        sorted(run_id for name, run_id in again["runs"].items() if name.startswith("agent/"))


# -- refusals ----------------------------------------------------------------------------------------------------

def _flip_a_steps_byte(run_dir):
    data = bytearray((run_dir / "training" / "steps.jsonl.gz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (run_dir / "training" / "steps.jsonl.gz").write_bytes(bytes(data))


def _edit_the_report(run_dir):
    path = run_dir / "report.json"
    report = json.loads(path.read_text())
    report["stages"][0]["metrics"]["selection.correct"] += 1
    path.write_text(json.dumps(report))


@pytest.mark.parametrize("flag", ["--wandb", "--mlflow"])
@pytest.mark.parametrize("damage", [_flip_a_steps_byte, _edit_the_report], ids=["damaged-steps", "edited-report"])
def test_a_run_folder_that_does_not_verify_is_refused_before_anything_is_written(grid, tmp_path, flag, damage):
    runs = tmp_path / "runs"
    shutil.copytree(grid["runs"], runs)
    run_dir = runs / grid["base"].name / "twin" / "seed-2"  # the last run exported: nothing may be written first
    damage(run_dir)
    shown = call_cli("show", run_dir)
    assert shown.code in (1, 3) and shown.stdout == "" and len(shown.stderr.strip().splitlines()) == 1, shown.stderr
    exported = call_cli("export", grid["lock"], "--runs-dir", runs, flag, tmp_path / "out")
    assert (exported.code, exported.stdout, exported.stderr) == (shown.code, "", shown.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, module, extra", [("--wandb", "wandb", "wandb"),
                                                 ("--mlflow", "mlflow.tracking", "mlflow")])
def test_without_the_package_the_export_says_what_to_install(grid, tmp_path, monkeypatch, flag, module,
                                                             extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if the package were not installed
    result = _export(grid, flag, tmp_path / "out")
    assert (result.code, result.stdout) == (1, "")
    assert result.stderr.strip().splitlines() == [
        f"opalctl: error: opalctl export {flag} needs the {extra} package, which is not installed; install it with "
        f"`pip install 'opalctl[{extra}]'`"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [[], ["--wandb", "a", "--mlflow", "b"], ["--tensorboard", "a", "--wandb", "b"]])
def test_export_takes_one_tracker(grid, tmp_path, flags):
    result = call_cli("export", grid["lock"], "--runs-dir", grid["runs"], *flags)
    assert (result.code, result.stdout) == (2, "") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "give one of --tensorboard DIR, --wandb DIR or --mlflow DIR" in result.stderr
    assert not (Path.cwd() / "a").exists()


@pytest.mark.parametrize("flag", ["--wandb", "--mlflow"])
def test_a_file_where_the_folder_goes_is_refused(grid, tmp_path, flag):
    (tmp_path / "out").write_text("mine")
    result = _export(grid, flag, tmp_path / "out")
    assert (result.code, result.stdout) == (2, "") and "is a file; give a folder" in result.stderr
    assert (tmp_path / "out").read_text() == "mine"


# -- the learning rate per parameter group -----------------------------------------------------------------------

def test_the_learning_rates_are_read_from_the_steps_lines_that_have_them(tmp_path):
    from opalctl.trackers import learning_rates

    path = tmp_path / "steps.jsonl.gz"
    lines = [{"update": 1, "loss": 2.0}, {"update": 2, "loss": 1.9, "lrs": None},
             {"update": 3, "loss": 1.8, "lrs": [0.001, 0.0005]}, {"update": 4, "loss": 1.7, "lrs": [0.002, None]}]
    with gzip.open(path, "wt") as handle:
        handle.write("".join(json.dumps(line) + "\n" for line in lines) + '{"update":5,"loss":1.6,"lrs":[NaN,1e-4]}\n')
    assert list(learning_rates(path)) == [(3, 0, 0.001), (3, 1, 0.0005), (4, 0, 0.002), (5, 1, 1e-4)]
    assert list(learning_rates(tmp_path / "absent.jsonl.gz")) == []


def test_the_learning_rates_reach_both_trackers(grid, tmp_path):
    """The steps of the session's runs may have no learning rates (an opalctl older than the field): the rates of
    two groups are put on a run as its steps would give them, and each tracker's writer is read back."""
    from opalctl.protocol.lock import read_lock
    from opalctl.trackers import mlflow_store, tracked_runs, wandb_offline

    lock, runs = tracked_runs(grid["lock"], grid["runs"])
    run = next(run for run in runs if run.arm == "agent")
    run.learning_rates = {0: [(update, seconds, 1e-3 * update) for update, seconds, _loss in run.loss],
                          1: [(update, seconds, 0.0) for update, seconds, _loss in run.loss[::2]]}
    expected = {f"train/lr/group-{group}": [(u, pytest.approx(r, rel=1e-12)) for u, _s, r in points]
                for group, points in run.learning_rates.items()}
    with wandb_offline.IsolatedWandb() as imported:
        folder = wandb_offline._write_run(imported, lock, run, tmp_path / "wandb-out")
    offline = OfflineRun(folder)
    assert {key: offline.series(key) for key in expected} == expected
    with mlflow_store._quiet_mlflow() as client_class:
        client = client_class(tracking_uri=mlflow_store.store_uri(tmp_path / "mlflow-out"))
        experiment = mlflow_store._experiment(client, read_lock(grid["lock"]), tmp_path / "mlflow-out" / "artifacts")
        run_id = mlflow_store._write_run(client, experiment, lock, run)
        assert {key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
                for key in expected} == expected


@pytest.mark.parametrize("flag, in_the_way, sentence", [
    ("--wandb", "wandb", "cannot write {out}/wandb: {out}/wandb is a file, not a folder; move it away"),
    ("--mlflow", "mlflow.db", "MLflow refused the store {out}/mlflow.db (file is not a database); give --mlflow a "
                              "folder of its own"),
    ("--mlflow", "artifacts", "cannot write {out}/artifacts: {out}/artifacts is a file, not a folder; move it away")])
def test_a_file_in_the_trackers_way_is_named_in_one_sentence_and_kept(grid, tmp_path, flag,
                                                                       in_the_way, sentence):
    out = tmp_path / "out"
    out.mkdir()
    (out / in_the_way).write_text("mine")
    result = _export(grid, flag, out)
    assert (result.code, result.stdout) == (1, ""), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and sentence.format(out=out) in result.stderr, result.stderr
    assert result.stderr.strip().endswith(f"then run `opalctl export` again (or give {flag} a folder that can be "
                                          f"written)")
    assert (out / in_the_way).read_text() == "mine"
    assert not (out / "wandb-staging").exists()
