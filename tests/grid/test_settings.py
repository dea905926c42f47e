"""The Slurm executor's settings (flags over a small YAML file), its time limit, and the grid's command line and
displays, none of which start a run."""

from __future__ import annotations

import io
import json

import pytest

from opalctl.errors import BadInput
from opalctl.grid.display import JsonLines, row
from opalctl.grid.records import GridResult, RunOutcome, command_line, event
from opalctl.grid.settings import load_settings, parse_sbatch_options
from opalctl.grid.slurm import MIN_TIME_LIMIT_MINUTES, time_limit_minutes
from tests.support.cli import call_cli


def test_flags_win_over_the_settings_file_and_sbatch_options_merge(tmp_path):
    path = tmp_path / "slurm.yaml"
    path.write_text("partition: cpu\naccount: lab\ntime_margin: 3\nsbatch: {qos: low, mem: 4G}\n")
    settings = load_settings(path, partition="gpu", sbatch=parse_sbatch_options(["qos=high"]))
    assert (settings.partition, settings.account, settings.time_margin) == ("gpu", "lab", 3)
    assert settings.sbatch == {"qos": "high", "mem": "4G"}
    assert load_settings(None).partition is None


@pytest.mark.parametrize("text, match", [
    ("partiton: cpu\n", "unknown key 'partiton'"),
    ("- cpu\n", "must hold a mapping"),
    ("time_margin: 0.5\n", "time_margin in .* at least 1"),
    ("time_limit_minutes: 0\n", "time_limit_minutes in .* at least 1"),
    ("partition: [unclosed\n", "cannot be read as YAML"),
])
def test_a_bad_settings_file_is_refused_in_one_sentence_naming_it(tmp_path, text, match):
    path = tmp_path / "slurm.yaml"
    path.write_text(text)
    with pytest.raises(BadInput, match=match) as refused:
        load_settings(path)
    assert str(path) in refused.value.message


def test_a_missing_settings_file_and_a_bad_sbatch_flag_are_refused(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        load_settings(tmp_path / "nope.yaml")
    with pytest.raises(BadInput, match="must be KEY=VALUE"):
        parse_sbatch_options(["qos"])


def test_the_time_limit_is_the_projection_times_the_margin_plus_the_work_outside_the_budget():
    assert time_limit_minutes(3600.0, 2.0) == 122  # 2 h of training and 2 min outside the budget
    assert time_limit_minutes(1.0, 2.0) == MIN_TIME_LIMIT_MINUTES, "never the few minutes of submitit's default"


def test_json_lines_print_each_state_change_and_each_tenth_of_the_budget_a_running_run_passes():
    """Piped, a running run's fraction and ETA reach the pipe as it trains (before, every line until it finished
    said "fraction": null), yet not one line per progress figure."""
    stream = io.StringIO()
    show = JsonLines(stream)
    show(event("adamw", 1, "running"))
    for fraction in (0.04, 0.12, 0.15, 0.19, 0.5, 0.51):
        show(event("adamw", 1, "running", fraction=fraction, updates=int(100 * fraction), eta_seconds=3.0))
    show(event("adamw", 2, "running", fraction=0.3, updates=30, eta_seconds=7.0))
    show(event("adamw", 1, "finished", fraction=1.0))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(line["event"], line["seed"], line["state"], line["fraction"]) for line in lines] == [
        ("run", 1, "running", None), ("progress", 1, "running", 0.12), ("progress", 1, "running", 0.5),
        ("run", 2, "running", 0.3), ("run", 1, "finished", 1.0)]
    assert lines[1]["eta_seconds"] == 3.0 and lines[1]["updates"] == 12


def test_the_live_table_shows_run_state_progress_updates_and_eta():
    assert row(event("adamw", 2, "running", fraction=0.25, updates=50, eta_seconds=75, resumed=True)) == \
        ["adamw seed 2", "running (resume)", " 25.0 %", "50", "1:15"]
    assert row(event("adamw", 2, "finished", fraction=1.0, eta_seconds=5)) == \
        ["adamw seed 2", "finished", "100.0 %", "-", "-"]


def test_the_way_on_after_a_stop_is_the_same_command():
    result = GridResult(lock="x/digits.lock.json", runs_dir="my runs", executor="slurm", jobs=2,
                        outcomes=[RunOutcome("adamw", 1, "interrupted", "r")], arms=["adamw"], seeds=[1])
    assert command_line(result) == ("opalctl grid x/digits.lock.json --arm adamw --seed 1 --runs-dir 'my runs' "
                                    "--executor slurm")
    assert not result.ok


def test_the_grid_command_refuses_an_unknown_arm_in_one_sentence(grid_project, tmp_path):
    result = call_cli("grid", grid_project.lock, "--arm", "nope", "--runs-dir", tmp_path)
    assert result.code == 2 and result.stderr.count("\n") == 1
    assert "arm nope is not in lock" in result.stderr and "Traceback" not in result.stderr
