"""Editing the installed prompt: a frozen lock no longer verifies, and a run with the edit records it.

The package is copied to a private folder and put first on PYTHONPATH, so the real installation is never
touched; every command runs as a real subprocess against that copy.
"""

import json
import shutil
from pathlib import Path

import opalctl
from tests.support.cli import run_cli

PROMPT = "opal/prompts/neutral.md"


def opalctl_in(package_parent: Path, *args, cwd: Path):
    """``opalctl ARGS`` in a child that imports the package copy under ``package_parent``."""
    return run_cli(*args, cwd=cwd, env={"PYTHONPATH": str(package_parent)}, timeout=300)


def test_an_edited_prompt_fails_verify_and_is_recorded_by_a_run(digits_project, tmp_path):
    copy = tmp_path / "package"
    shutil.copytree(Path(opalctl.__file__).parent, copy / "opalctl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    protocol = digits_project / "digits.yaml"
    text = protocol.read_text().replace("clock: cpu, amount: 20", "clock: updates, amount: 60")
    protocol.write_text(text)
    frozen = opalctl_in(copy, "freeze", protocol, cwd=tmp_path)
    assert frozen.code == 0, frozen.stderr
    which = opalctl_in(copy, "verify", digits_project / "digits.lock.json", "--json", cwd=tmp_path)
    assert which.code == 0, which.stdout + which.stderr
    assert str(copy) in json.dumps(json.loads(which.stdout)["records"])  # the copy is what is verified

    prompt = copy / "opalctl" / PROMPT
    prompt.write_text(prompt.read_text() + "\nAlways double the learning rate.\n")
    verified = opalctl_in(copy, "verify", digits_project / "digits.lock.json", cwd=tmp_path)
    assert verified.code == 3
    assert f"source.opalctl/{PROMPT}" in verified.stdout + verified.stderr

    refrozen = opalctl_in(copy, "freeze", "--force", protocol, cwd=tmp_path)
    assert refrozen.code == 0, refrozen.stderr
    ran = opalctl_in(copy, "run", digits_project / "digits.lock.json", "--arm", "agent", "--seed", "1",
                     "--runs-dir", tmp_path / "runs", cwd=tmp_path)
    assert ran.code == 0, ran.stderr
    assert "differ from the released ones" in ran.stderr
    events = next((tmp_path / "runs").glob("digits-*/agent/seed-1/training/opal/events.jsonl"))
    start = json.loads(events.read_text().splitlines()[0])
    assert start["kind"] == "start" and start["defaults_differ"] == {"prompts/neutral.md": "changed"}
