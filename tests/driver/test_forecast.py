"""The pilot's forecast of a run's and a grid's wall time (driver/forecast.py, driver/pilot.py, grid --forecast).

Its arithmetic is checked on figures (the parts add up, runs share the cores once they outnumber them, an agent's
waiting is estimate's); a real pilot is checked to print the forecast with what it assumed. No test asserts a time:
bench/forecast.py measures the forecast against real runs."""

from __future__ import annotations

import json

import pytest

from opalctl.driver.forecast import PARTS, RunForecast, grid_forecast, grid_wall, run_lines, slowdown
from tests.support.cli import call_cli


def a_run(**parts) -> RunForecast:
    figures = {name: 0.0 for name in PARTS}
    figures.update(parts)
    return RunForecast(updates=100.0, assumptions=("training: as measured",), **figures)


def test_the_parts_of_a_run_add_up_to_its_forecast():
    run = a_run(start=7.5, training=30.0, between_updates=0.25, stages=0.5, checkpoints=0.75, agent_waiting=250.0,
                close=3.0)
    assert run.total == pytest.approx(7.5 + 30 + 0.25 + 0.5 + 0.75 + 250 + 3)
    data = run.to_json()
    assert list(data["components"]) == list(PARTS)
    assert data["total_seconds"] == pytest.approx(sum(data["components"].values()))
    assert data["assumptions"] == ["training: as measured"]
    json.dumps(data)  # what --json prints


def test_a_grid_of_one_slot_takes_the_sum_of_its_runs():
    assert grid_wall([10.0, 20.0, 30.0], jobs=1, cpus_per_run=1, cores=2)["seconds"] == pytest.approx(60.0)


def test_runs_with_a_core_each_take_as_long_as_the_longest_wave():
    scheduled = grid_wall([10.0, 20.0, 30.0, 5.0], jobs=2, cpus_per_run=1, cores=2)
    # slot 1: 10, then 30 (ends at 40); slot 2: 20, then 5 (ends at 25)
    assert scheduled["finish"] == pytest.approx([10.0, 20.0, 40.0, 25.0])
    assert scheduled["seconds"] == pytest.approx(40.0) and scheduled["slowdown"] == 1.0


def test_more_jobs_than_cores_share_them_and_gain_nothing():
    # two runs of 10 s on one core: each goes at half speed while both run, so both end at 20 s
    scheduled = grid_wall([10.0, 10.0], jobs=2, cpus_per_run=1, cores=1)
    assert scheduled["finish"] == pytest.approx([20.0, 20.0]) and scheduled["slowdown"] == 2.0
    # a short and a long run on one core: the long one goes at full speed once the short one ends
    assert grid_wall([10.0, 30.0], jobs=2, cpus_per_run=1, cores=1)["finish"] == pytest.approx([20.0, 40.0])
    # runs of two threads each: two of them fill two cores, three of them overfill them by half
    assert slowdown(2, 2, 4) == 1.0 and slowdown(3, 2, 4) == 1.5 and slowdown(1, 8, 2) == 4.0


def test_a_grid_forecast_says_how_the_cores_are_shared():
    shared = grid_forecast([("adamw", 1, 10.0), ("adamw", 2, 10.0), ("sgd", 1, 10.0)], jobs=3, cpus_per_run=1,
                           cores=2)
    assert shared["seconds"] == pytest.approx(15.0) and shared["slowdown"] == 1.5
    said = " ".join(shared["assumptions"])
    assert "2 core(s), 1 per run" in said and "3 run(s) at once share the cores, each 1.5x slower" in said
    assert "fewer updates" in said  # the cpu clock's charge under shared cores
    alone = grid_forecast([("adamw", 1, 10.0)], jobs=4, cpus_per_run=1, cores=2)
    assert alone["seconds"] == pytest.approx(10.0) and "each have their own cores" in " ".join(alone["assumptions"])
    assert [run["ends_at"] for run in shared["runs"]] == pytest.approx([15.0, 15.0, 15.0])


def test_the_printed_forecast_names_every_part_and_assumption():
    lines = run_lines(a_run(start=5.0, training=100.0, close=2.0).to_json())
    assert lines[0].startswith("one run: 107 s of wall time (start 5.0 s, training 100 s, close 2.0 s)")
    assert lines[1] == "  assumed: training: as measured"


def test_the_resume_checkpoints_counted_are_the_runs():
    from opalctl.driver.pilot import _resume_checkpoints

    # update 0, every tenth of the budget, and the stages at 0.25 and 0.75 (0.5 and 1.0 are tenths already)
    assert _resume_checkpoints([0.25, 0.5, 0.75, 1.0], 0.1) == 13
    assert _resume_checkpoints([1.0], 1.0) == 2


# --------------------------------------------------------------------------------------------------------------
# real pilots


@pytest.fixture
def frozen(digits_project, monkeypatch):
    """The digits project on the updates clock, with an agent arm that keeps training waiting (no key needed to
    forecast it)."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    path = digits_project / "digits.yaml"
    arm = "  claude: {optimizer: {name: AdamW, lr: 1.0e-3}, agent: {backend: anthropic, decisions: 3}}\n"
    text = path.read_text(encoding="utf-8").replace("selection:\n", arm + "selection:\n", 1)
    path.write_text(text.replace("clock: cpu, amount: 20", "clock: updates, amount: 600"), encoding="utf-8")
    result = call_cli("freeze", path)
    assert result.code == 0, result.output
    return digits_project / "digits.lock.json"


def test_a_pilot_on_the_updates_clock_forecasts_the_runs_wall_time_and_says_what_it_assumed(frozen):
    result = call_cli("pilot", frozen, "--arm", "adamw-long", "--steps", "4", "--seconds", "0")
    assert result.code == 0, result.output
    out = result.stdout
    assert "projected updates (1800 updates)" in out  # the multiplier of adamw-long
    run_line = next(line for line in out.splitlines() if line.startswith("one run: "))
    for part in ("start", "training", "stages", "checkpoints", "close"):
        assert f"({part} " in run_line or f", {part} " in run_line, run_line
    assumed = [line.removeprefix("  assumed: ") for line in out.splitlines() if line.startswith("  assumed: ")]
    assert [line.split(":")[0] for line in assumed] == ["training", "start", "stages", "checkpoints", "close"]
    assert assumed[0].startswith("training: 1,800 updates x ") and "of warm-up" in assumed[0]
    assert "2 interpreters importing torch" in assumed[1] and "the lock checked twice" in assumed[1]


def test_an_agent_arms_forecast_adds_estimates_waiting(frozen):
    result = call_cli("pilot", frozen, "--arm", "claude", "--steps", "4", "--seconds", "0", "--json")
    assert result.code == 0, result.output
    report = json.loads(result.stdout)
    waiting = report["agent_forecast"]["waiting_seconds"]["typical"]
    assert report["agent_forecast"]["decisions"] == 3 and waiting > 0
    forecast = report["forecast"]
    assert forecast["components"]["agent_waiting"] == pytest.approx(waiting)
    assert forecast["total_seconds"] == pytest.approx(sum(forecast["components"].values()))
    assert any(line.startswith("agent: 3 decisions") for line in forecast["assumptions"])
    plain = json.loads(call_cli("pilot", frozen, "--arm", "adamw", "--steps", "4", "--seconds", "0",
                                     "--json").stdout)
    assert plain["forecast"]["components"]["agent_waiting"] == 0.0


def test_grid_forecast_pilots_each_arm_and_schedules_the_runs_left(frozen, tmp_path):
    result = call_cli("grid", frozen, "--forecast", "--arm", "adamw", "--arm", "adamw-cosine", "--jobs", "2",
                           "--runs-dir", tmp_path / "runs", "--json")
    assert result.code == 0, result.output
    forecast = json.loads(result.stdout)
    from opalctl.grid.plan import plan_grid

    plan = plan_grid(frozen, arms=["adamw", "adamw-cosine"], runs_dir=tmp_path / "runs")
    assert [(run["arm"], run["seed"]) for run in forecast["runs"]] == [(run.arm, run.seed) for run in plan.runs]
    assert len(forecast["runs"]) == 2 * len(plan.seeds)
    assert forecast["jobs"] == 2 and set(forecast["arms"]) == {"adamw", "adamw-cosine"}
    assert forecast["seconds"] >= max(run["seconds"] for run in forecast["runs"])
    assert not (tmp_path / "runs").exists()  # a forecast starts nothing
