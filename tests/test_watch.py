"""``opalctl watch``: a real grid (the AdamW arm and the heuristic agent's, one seed, an ``updates`` budget of
about 15 s) watched while it trains by a real ``opalctl watch --json`` process, then its finished folders watched
again; every test reads the runs the module made once."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.support.cli import call_cli, child_env, opalctl_command

UPDATES = 600
ARMS = {"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}},
        "agent": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}, "agent": {"backend": "heuristic", "decisions": 4}}}
TIMEOUT = 300


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _folder_state(folder: Path) -> dict[str, tuple]:
    """Every file and folder under ``folder``: its kind, size, modification time and, for a file, its bytes."""
    found = {}
    for path in sorted(folder.rglob("*")):
        status = path.lstat()
        found[path.relative_to(folder).as_posix()] = (
            path.is_dir(), status.st_size, status.st_mtime_ns, None if path.is_dir() else path.read_bytes())
    return found


@pytest.fixture(scope="module")
def watched_grid(digits_init_folder, tmp_path_factory):
    """The lock, its runs folder, and what ``watch --json`` printed (and its exit code) while the grid ran."""
    from opalctl.protocol.freeze import freeze

    root = tmp_path_factory.mktemp("watch")
    project = root / "project"
    shutil.copytree(digits_init_folder, project, ignore=shutil.ignore_patterns(".complete"))
    protocol = yaml.safe_load((project / "digits.yaml").read_text())
    protocol.update(seeds=[1], budget={"clock": "updates", "amount": UPDATES, "threads": 1}, arms=ARMS)
    (project / "digits.yaml").write_text(yaml.safe_dump(protocol, sort_keys=False))
    lock = Path(freeze(project / "digits.yaml", force=True)["lock"])
    runs = root / "runs"
    grid = subprocess.Popen(opalctl_command("grid", lock, "--jobs", 2, "--runs-dir", runs, "--json"), env=child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = subprocess.Popen(opalctl_command("watch", lock, "--runs-dir", runs, "--json", "--interval", 0.3), env=child_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        watched, watch_err = watch.communicate(timeout=TIMEOUT)
        grid_out, grid_err = grid.communicate(timeout=TIMEOUT)
    finally:
        for process in (watch, grid):
            if process.poll() is None:
                process.kill()
    assert grid.returncode == 0, grid_err
    return {"lock": lock, "runs": runs, "lines": _lines(watched), "code": watch.returncode, "stderr": watch_err,
            "grid": _lines(grid_out)}


def test_watching_a_running_grid_sees_each_run_start_train_judge_decide_and_end(watched_grid):
    assert watched_grid["code"] == 0, watched_grid["stderr"]
    lines = watched_grid["lines"]
    end = lines[-1]
    assert end["event"] == "end" and not end["stopped"], "it ends by itself once the grid's runs have ended"
    assert {run["arm"]: run["state"] for run in end["runs"]} == {"adamw": "finished", "agent": "finished"}
    for arm in ARMS:
        mine = [line for line in lines if line.get("arm") == arm]
        states = [line["state"] for line in mine if line["event"] == "state"]
        assert "running" in states and states[-1] == "finished" and states.index("running") < len(states) - 1, states
        finished_at = max(i for i, line in enumerate(mine) if line["event"] == "state")
        progress = [line for line in mine[:finished_at] if line["event"] == "progress"]
        assert progress and all(line["state"] == "running" and 0 < line["fraction"] <= 1 for line in progress)
        assert [line["fraction"] for line in progress] == sorted(line["fraction"] for line in progress)
        stages = [line for line in mine[:finished_at] if line["event"] == "stage"]
        assert [stage["stage"] for stage in stages] == [1, 2, 3, 4], "each stage once, as it is judged"
        assert all(isinstance(stage["promoted"], bool) and stage["metrics"] for stage in stages)
        assert all(stage["promoted"] or stage["reasons"] for stage in stages), "a refusal says why"
    decisions = [line for line in lines if line["event"] == "decision"]
    assert {line["arm"] for line in decisions} == {"agent"}
    assert [line["decision"] for line in decisions] == [1, 2, 3, 4], "each decision once, as it is made"
    assert all(line["outcome"] in ("applied", "kept") and line["said"] for line in decisions)
    # the watch saw a decision while the run was still going, not only at its end
    agent = [line for line in lines if line.get("arm") == "agent"]
    first_decision = next(i for i, line in enumerate(agent) if line["event"] == "decision")
    assert any(line["event"] == "progress" for line in agent[first_decision:])


def test_once_json_on_finished_runs_gives_their_stages_decisions_and_state(watched_grid):
    agent_dir = next(Path(run["run_dir"]) for run in watched_grid["grid"][-1]["runs"] if run["arm"] == "agent")
    result = call_cli("watch", agent_dir, "--once", "--json")  # in this process: a child is not what it is about
    assert result.code == 0, result.stderr
    view = result.json()
    assert view["kind"] == "run" and view["ended"] and len(view["runs"]) == 1
    run = view["runs"][0]
    assert run["state"] == "finished" and run["fraction"] == 1.0 and run["updates"] == UPDATES
    assert [stage["stage"] for stage in run["stages"]] == [1, 2, 3, 4]
    report = json.loads((agent_dir / "report.json").read_text())
    assert [stage["promoted"] for stage in run["stages"]] == [stage["promoted"] for stage in report["stages"]]
    assert [d["decision"] for d in run["decisions"]] == [1, 2, 3, 4]
    assert all(d["said"] for d in run["decisions"])
    assert run["loss"] is not None and run["lrs"] and len(run["recent_losses"]) > 0

    whole = call_cli("watch", watched_grid["lock"], "--runs-dir", watched_grid["runs"], "--once", "--json")
    assert whole.code == 0, whole.stderr
    assert {r["arm"]: r["state"] for r in whole.json()["runs"]} == {"adamw": "finished", "agent": "finished"}
    assert whole.json()["runs"][0]["decisions"] == [] or whole.json()["runs"][1]["decisions"] == []

    shown = call_cli("watch", watched_grid["lock"], "--runs-dir", watched_grid["runs"], "--once")
    assert shown.code == 0, shown.stderr
    assert "agent seed 1" in shown.stdout and "adamw seed 1" in shown.stdout and "finished" in shown.stdout


def test_watch_writes_nothing_into_the_run_folders(watched_grid):
    """Every way of watching a lock and a run, in this process (what it writes is the point, not a child)."""
    base = watched_grid["runs"]
    before = _folder_state(base)
    for args in (("--once",), ("--once", "--json"), ("--json", "--interval", "0.2"), ()):
        result = call_cli("watch", watched_grid["lock"], "--runs-dir", base, *args)
        assert result.code == 0, result.stderr
        agent_dir = next(p for p in base.glob("*/agent/seed-1"))
        assert call_cli("watch", agent_dir, *args).code == 0
    assert _folder_state(base) == before


def test_ctrl_c_ends_the_watch_with_exit_0_and_an_end_line(watched_grid, tmp_path):
    # the lock's runs under an empty folder: nothing started, so the watch waits until told to stop
    watch = subprocess.Popen(opalctl_command("watch", watched_grid["lock"], "--runs-dir", tmp_path, "--json",
                                      "--interval", 0.2), env=child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    first = watch.stdout.readline()  # the first state line: it is watching
    assert json.loads(first)["state"] == "not started"
    assert time.monotonic() < deadline
    watch.send_signal(signal.SIGINT)
    rest, stderr = watch.communicate(timeout=60)
    assert watch.returncode == 0, stderr
    end = _lines(rest)[-1]
    assert end["event"] == "end" and end["stopped"] is True
    assert list(tmp_path.iterdir()) == [], "watching made no folder"


@pytest.mark.parametrize("make, words", [
    (lambda tmp: tmp / "missing", "does not exist"),
    (lambda tmp: tmp, "is a folder but not a run folder"),
    (lambda tmp: (tmp / "notes.yaml", (tmp / "notes.yaml").write_text("a: 1\n"))[0], "neither a run folder nor a lock"),
])
def test_a_path_that_is_neither_a_run_folder_nor_a_lock_is_refused_in_one_sentence(make, words, tmp_path):
    path = make(tmp_path)
    result = call_cli("watch", path, "--once")
    assert result.code == 2
    assert result.stdout == "" and words in result.stderr and str(path) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
