"""Formal runs on a CUDA device, end to end through the command line: the digits project with
``training.device: cuda``, the fixed arm and the keep agent arm (its training process confined as on CPU), on the
``updates`` clock and on the ``gpu`` clock (CUDA events), and a run killed and resumed. What a GPU user first does with opalctl, which no CPU test
can show: the model, the batches and the optimizer's state on the device, the checkpoints and the evaluator's
reading of them, and the agent arm's confinement with a device open."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import ADAMW, KILLABLE_TASK, LENIENT, Project
from tests.support.cli import call_cli

pytestmark = pytest.mark.cuda
KEEP = {**ADAMW, "agent": {"backend": "keep"}}
ARMS = {"adamw": ADAMW, "keep": KEEP}


@pytest.fixture(scope="module")
def project(digits_init_folder, tmp_path_factory) -> Project:
    return Project(digits_init_folder, tmp_path_factory.mktemp("cuda") / "project")


def finished(project: Project, arm: str, seed: int = 1) -> dict:
    try:
        result = project.process(project.run_args(arm, seed), timeout=180)
    except subprocess.TimeoutExpired as stopped:  # what a hang printed, rather than the test's own stack
        pytest.fail(f"the {arm} run on seed {seed} did not end in 180 s; it printed: "
                    f"{(stopped.stdout or b'')[-2000:]!r} {(stopped.stderr or b'')[-2000:]!r}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = project.run_dir(arm, seed)
    code, out, err = call_cli("verify", str(run_dir))
    assert code == 0, out + err
    return json.loads((run_dir / "report.json").read_text())


def test_on_the_updates_clock_the_keep_agent_arm_ends_with_the_fixed_arms_weights_on_cuda(project):
    project.freeze(budget={"clock": "updates", "amount": 60}, training={"device": "cuda"}, arms=ARMS,
                   selection=LENIENT)
    fixed, keep = finished(project, "adamw"), finished(project, "keep")
    print("confinement of the keep arm on this machine:", json.dumps(keep.get("confinement"), indent=1))
    assert fixed["budget"]["used"] == keep["budget"]["used"] == 60
    assert keep["final_model_sha256"] == fixed["final_model_sha256"]
    assert fixed["peak_device_memory_bytes"] > 0


def test_on_the_gpu_clock_a_run_spends_its_device_seconds_and_verifies(project):
    project.freeze(budget={"clock": "gpu", "amount": 1.0}, training={"device": "cuda"}, arms=ARMS,
                   selection=LENIENT)
    for arm in ARMS:
        report = finished(project, arm, seed=2)
        budget = report["budget"]
        print(f"gpu clock, {arm}: {json.dumps(budget)}")
        assert budget["clock"] == "gpu" and budget["total"] == 1.0
        assert 0.9 <= budget["used"] <= 1.1, budget


def test_a_keep_agent_arm_killed_on_cuda_resumes_to_the_weights_of_an_uninterrupted_run(project):
    """The resume checkpoint holds the optimizer's state and the random generators of the device too."""
    entry = project.task_module(KILLABLE_TASK, "KillableDigits")
    project.freeze(budget={"clock": "updates", "amount": 60}, training={"device": "cuda", "checkpoint_every": 0.1},
                   arms=ARMS, selection=LENIENT, entry=entry)
    whole = finished(project, "keep", seed=1)
    killed = project.folder.parent / "killed"
    result = project.process(project.run_args("keep", 1, runs=killed), env=project.env(KILL_LOSS_AT="40"))
    assert result.returncode != 0, result.stderr[-3000:]
    result = project.process(project.run_args("keep", 1, "--resume", runs=killed))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = project.run_dir("keep", 1, runs=killed)
    code, out, err = call_cli("verify", str(run_dir))
    assert code == 0, out + err
    resumed = json.loads((run_dir / "report.json").read_text())
    assert resumed["final_model_sha256"] == whole["final_model_sha256"]
