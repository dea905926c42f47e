"""The command line as a user meets it: instant help, exit codes, and a pilot that measures without writing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import opalctl
from tests import support
from tests.support.cli import call_cli, run_cli

NO_TORCH = textwrap.dedent("""
    import sys
    from opalctl.cli import main
    try:
        main(sys.argv[1:])
    except SystemExit as exit_:
        code = exit_.code or 0
    else:
        code = 0
    heavy = sorted(m for m in ("torch", "numpy", "sklearn", "pydantic") if m in sys.modules)
    assert heavy == [], f"--help imported {heavy}"
    sys.exit(code)
""")


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_importing_the_cli_does_not_import_torch():
    result = python("-c", "import sys, opalctl.cli; assert 'torch' not in sys.modules, 'torch was imported'")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["freeze", "--help"], ["verify", "--help"],
                                  ["pilot", "--help"], ["init", "--help"], ["--version"], ["compare", "--help"],
                                  ["report", "--help"], ["export", "--help"], ["show", "--help"]])
def test_help_exits_0_without_importing_torch(args):
    result = python("-c", NO_TORCH, *args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_the_real_help_command():
    result = run_cli("--help")
    assert result.code == 0
    assert "Usage: opalctl" in result.stdout
    for command in ("init", "freeze", "verify", "pilot", "compare", "show", "report", "export"):
        assert command in result.stdout


def test_the_new_flags_are_in_the_help():
    for command, flags in (("compare", ("--stage", "--metric", "--csv")), ("show", ("--reasons", "--html")),
                           ("report", ("--out", "--runs-dir")), ("export", ("--tensorboard",))):
        result = call_cli(command, "--help")
        assert result.code == 0 and all(flag in result.stdout for flag in flags), command


def test_version():
    result = call_cli("--version")
    assert result.code == 0 and opalctl.__version__ in result.stdout


@pytest.mark.parametrize("args", [
    ["freeze", "--no-such-flag", "x.yaml"],
    ["verify"],
    ["no-such-command"],
    ["pilot", "x.lock.json"],  # --arm is required
    ["pilot", "x.lock.json", "--arm", "adamw", "--steps", "0"],
    ["pilot", "x.lock.json", "--arm", "adamw", "--steps", "many"],
])
def test_a_bad_flag_exits_2_with_one_line(args):
    result = call_cli(*args)
    assert result.code == 2, result.output
    assert result.stderr.startswith("opalctl: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output


def test_a_bad_flag_exits_2_in_a_real_process():
    result = run_cli("verify", "--colour", "x.lock.json")
    assert result.code == 2
    assert result.stderr.startswith("opalctl: error: No such option") and "--colour" in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""


@pytest.mark.parametrize("command", ["freeze", "pilot"])
def test_a_missing_protocol_file_exits_2(tmp_path, command):
    missing = tmp_path / "nowhere.yaml"
    extra = ["--arm", "adamw"] if command == "pilot" else []
    result = call_cli(command, missing, *extra)
    assert result.code == 2
    assert result.stderr == (f"opalctl: error: protocol {missing} does not exist; check the path (or write one "
                             f"with `opalctl init`)\n")


def test_a_missing_protocol_file_exits_2_in_a_real_process(tmp_path):
    result = run_cli("freeze", tmp_path / "nowhere.yaml")
    assert result.code == 2 and result.stderr.startswith("opalctl: error: protocol ")
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------------------------------------------
# pilot


@pytest.fixture
def frozen_project(digits_project):
    result = call_cli("freeze", digits_project / "digits.yaml")
    assert result.code == 0, result.output
    return digits_project


def test_pilot_reports_throughput_and_writes_nothing(frozen_project, tmp_path):
    lock = frozen_project / "digits.lock.json"
    before = support.tree(tmp_path)
    result = run_cli("pilot", lock, "--arm", "adamw", "--steps", "4", "--seconds", "0", "--json", cwd=tmp_path)
    assert result.code == 0, result.output
    report = result.json()
    assert report["formal"] is False and report["arm"] == "adamw" and report["seed"] == 1
    assert report["steps"] == 4
    assert report["cpu_seconds_per_update"] > 0 and report["wall_seconds_per_update"] > 0
    assert report["projected_updates"] > 0
    assert report["projected_updates"] == pytest.approx(20 / report["cpu_seconds_per_update"])
    assert report["checkpoint_bytes"] > 4 * report["parameters"] > 0  # float32 weights at the least
    assert report["budget"] == {"clock": "cpu", "amount": 20.0, "fractions": [0.25, 0.5, 0.75, 1.0]}
    assert support.tree(tmp_path) == before  # no file written, changed or removed anywhere under tmp_path
    assert not (tmp_path / "runs").exists() and not (frozen_project / "runs").exists()


def test_pilot_of_an_unknown_arm_exits_2(frozen_project):
    result = call_cli("pilot", frozen_project / "digits.lock.json", "--arm", "sgd")
    assert result.code == 2
    assert "has no arm 'sgd'; its arms are adamw, adamw-anneal-end, adamw-cosine, adamw-long, agent" in result.stderr
    assert result.stderr.count("\n") == 1


def test_pilot_of_an_unknown_seed_exits_2(frozen_project):
    result = call_cli("pilot", frozen_project / "digits.lock.json", "--arm", "adamw", "--seed", "9")
    assert result.code == 2 and "seed 9 is not one of the protocol's seeds" in result.stderr


@pytest.mark.parametrize("relative, role", [("data/digits/train.npz", "data.train"),
                                            ("parents/digits/seed-1.pt", "parent.seed-1")])
def test_pilot_of_a_lock_whose_input_changed_exits_3(frozen_project, relative, role):
    support.flip_byte(frozen_project / relative)
    result = call_cli("pilot", frozen_project / "digits.lock.json", "--arm", "adamw", "--steps", "1")
    assert result.code == 3, result.output
    assert result.stderr.startswith("opalctl: error: ") and result.stderr.count("\n") == 1
    assert f"{role} {relative} changed" in result.stderr
    assert result.stdout == ""


# --------------------------------------------------------------------------------------------------------------
# init


def test_init_refuses_bad_input_before_it_says_it_is_preparing(tmp_path):
    folder = tmp_path / "project"
    result = run_cli("init", "nope", "--dir", folder)
    assert result.code == 2, result.output
    assert result.stderr.startswith("opalctl: error: there is no built-in task 'nope'"), result.stderr
    assert result.stderr.count("\n") == 1 and "preparing" not in result.stderr and result.stdout == ""
    assert not folder.exists()  # refused before anything was made


# --------------------------------------------------------------------------------------------------------------
# errors


def test_the_details_of_an_error_are_printed_indented_under_its_sentence(monkeypatch):
    from opalctl.errors import BadInput
    from opalctl.protocol import freeze

    def refuse(*args, **kwargs):
        raise BadInput("the sentence", details=["one thing", "another"])

    monkeypatch.setattr(freeze, "freeze", refuse)
    result = call_cli("freeze", "x.yaml")
    assert result.code == 2 and result.stderr == "opalctl: error: the sentence\n  one thing\n  another\n"
