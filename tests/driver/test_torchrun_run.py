"""Formal runs under real ``torchrun --nproc-per-node 2`` (gloo, CPU): one launch of ``torchrun_worker.py`` for
the finished runs (a fixed arm and the agent arms that wrap it) and the charge rule, one that kills rank 1 mid-run,
and one ``torchrun -m opalctl run --resume`` that continues it (the heuristic agent arm: every rank's own agent
optimizer state travels in resume.pt); the tests read what the ranks reported and what the run folders hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import support
from tests.support.cli import call_cli

WORKER = Path(__file__).with_name("torchrun_worker.py")
ROOT = Path(__file__).resolve().parents[2]
UPDATES = 12  # stages at 6 and 12; a resume checkpoint every 3 updates
KILL_AT = 8  # rank 1's update that never ends: after the checkpoint at update 6, before the one at 9
# agent arms wrapping the fixed arm: keep (never changes the program) and the heuristic agent, deciding early
AGENT_ARMS = {"keep": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}, "agent": {"backend": "keep", "decisions": 1}},
              "heuristic": {"optimizer": {"name": "AdamW", "lr": 1.0e-3},
                            "agent": {"backend": "heuristic", "decisions": 2, "trial_steps": 2}}}


def torchrun(project, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node 2 ARGS`` (what the ``torchrun`` script
    runs), with this worktree's opalctl."""
    env = project.env(OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           *args], cwd=project.folder.parent, env=env, capture_output=True, text=True, timeout=240)
    if check:
        assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
    return done


def ranks_seen(out: Path) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text(encoding="utf-8")) for rank in (0, 1)]


def freeze_ranks(template: Path, folder: Path, clock: str, ranks: int, *, amount: int = UPDATES,
                 arms: dict | None = None):
    project = support.Project(template, folder, pytest.MonkeyPatch())
    project.freeze(budget={"clock": clock, "amount": amount, "fractions": [0.5, 1.0]},
                   training={"checkpoint_every": 0.25, "ranks": ranks},
                   arms=arms or {"adamw": support.ADAMW}, selection=support.LENIENT)
    return project


@pytest.fixture(scope="module")
def world(digits_template, tmp_path_factory):
    """The worker's launch over two frozen locks of two ranks (the updates clock; the cpu clock, whose charges
    are twice as large: three per update, to spend the same number of updates)."""
    base = tmp_path_factory.mktemp("torchrun")
    updates = freeze_ranks(digits_template, base / "updates", "updates", 2,
                           arms={"adamw": support.ADAMW, **AGENT_ARMS})
    cpu = freeze_ranks(digits_template, base / "cpu", "cpu", 2, amount=3 * UPDATES // 2)
    out = base / "out"
    out.mkdir()
    torchrun(updates, str(WORKER), "runs", str(out), str(base / "runs"), str(updates.lock), str(cpu.lock))
    return updates, base / "runs", ranks_seen(out)


@pytest.fixture(scope="module")
def killed(world, tmp_path_factory):
    """The 2-rank run of ``world``'s heuristic agent arm, rank 1 killed by SIGKILL at its update KILL_AT (after
    the agent's first decision), then ``torchrun -m opalctl run LOCK --resume``."""
    project, _, _ = world
    base = tmp_path_factory.mktemp("killed")
    out, runs = base / "out", base / "runs"
    out.mkdir()
    died = torchrun(project, str(WORKER), "kill", str(out), str(runs), str(project.lock), str(KILL_AT), "heuristic",
                    check=False)
    run_dir = project.run_dir("heuristic", 1, runs=runs)
    state = {"returncode": died.returncode, "rank-0": json.loads((out / "rank-0.json").read_text()),
             "files": sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file()),
             "events": [json.loads(line)["kind"] for line in (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()]}
    resumed = torchrun(project, "-m", "opalctl", *project.run_args("heuristic", 1, "--resume", runs=runs), "--json")
    return state, resumed, run_dir


def test_a_two_rank_fixed_arm_finishes_and_its_folder_verifies(world):
    project, runs, seen = world
    run_dir = Path(seen[0]["plain"]["run_dir"])
    assert seen[0]["plain"]["updates"] == UPDATES and seen[0]["plain"]["ranks"] == 2
    assert seen[1]["plain"] == seen[0]["plain"]  # every rank ends with rank 0's report
    code, out, err = call_cli("verify", str(run_dir))
    assert code == 0, out + err
    assert json.loads((run_dir / "start.json").read_text())["ranks"] == 2


def test_a_two_rank_folder_holds_exactly_what_a_one_rank_folder_holds(world, digits_template, tmp_path):
    project, runs, seen = world
    two = Path(seen[0]["plain"]["run_dir"])
    single = freeze_ranks(digits_template, tmp_path / "single", "updates", 1)
    report = single.run("adamw", 1)
    one = Path(report["run_dir"])
    listing = sorted(str(p.relative_to(two)) for p in two.rglob("*"))
    assert listing == sorted(str(p.relative_to(one)) for p in one.rglob("*"))
    assert "ranks" not in report and "ranks" not in json.loads((one / "start.json").read_text())
    assert not [p for p in two.parent.iterdir() if p.name not in {"seed-1", ".seed-1.lock"}]


def test_starting_a_finished_two_rank_run_again_is_refused_on_both_ranks_in_rank_0s_sentence(world):
    _, _, seen = world
    refused = seen[0]["again"]
    assert refused is not None and refused["exit_code"] == 2 and "already finished" in refused["message"]
    assert seen[1]["again"] == refused


def test_the_charge_is_the_maximum_over_ranks_for_updates_and_the_sum_for_cpu(world):
    _, _, seen = world
    for rank in seen:
        # rank r charges r + 1: max charges 2 per update (12 buys 6 updates), sum 3 (18 buys 6)
        assert rank["max"]["budget"]["used"] == 2 * (UPDATES // 2) and rank["max"]["updates"] == UPDATES // 2
        assert rank["sum"]["budget"]["used"] == 3 * (UPDATES // 2) and rank["sum"]["updates"] == UPDATES // 2
        # every rank's meter took the same decisions: each rank measured as many updates as rank 0 reported
        assert rank["max"]["measured"] == rank["sum"]["measured"] == UPDATES // 2


def test_sigkill_of_rank_1_of_an_agent_arm_then_resume_under_torchrun_ends_as_the_uninterrupted_run(world, killed):
    _, _, seen = world
    state, resumed, run_dir = killed
    assert state["returncode"] != 0 and "training/resume.pt" in state["files"] and "report.json" not in state["files"]
    assert "applied" in state["events"]  # killed while the agent's program ran: its state is in resume.pt
    # rank 0 stops on torchrun's SIGTERM, or on its collective with the rank that is gone, whichever comes first
    assert f"resume with: torchrun --nproc-per-node 2 -m opalctl run {world[0].lock} " in state["rank-0"]["error"]
    report = json.loads(resumed.stdout)
    assert report["resumes"] == 1 and report["ranks"] == 2
    assert report["final_model_sha256"] == seen[0]["heuristic"]["final_model_sha256"]
    assert report["rows_digest"] == seen[0]["heuristic"]["rows_digest"]
    assert not (run_dir / "training" / "resume.pt").exists()


def test_a_lock_of_two_ranks_run_without_torchrun_is_refused_naming_the_torchrun_command(world):
    project, _, _ = world
    code, out, err = call_cli(*project.run_args("adamw", 1, runs=project.folder / "elsewhere"))
    assert code == 2
    assert f"run `torchrun --nproc-per-node 2 -m opalctl run {project.lock} --arm adamw --seed 1" in err
    assert "Traceback" not in err and not (project.folder / "elsewhere").exists()


def test_a_two_rank_keep_agent_arm_ends_with_the_fixed_arms_weights_and_its_folder_verifies(world):
    _, _, seen = world
    keep = seen[0]["keep"]
    assert keep["updates"] == UPDATES and keep["final_model_sha256"] == seen[0]["plain"]["final_model_sha256"]
    assert seen[1]["keep"] == keep
    code, out, err = call_cli(*["verify", keep["run_dir"]])
    assert code == 0, out + err


def test_a_two_rank_heuristic_agent_arm_finishes_on_both_ranks_with_rank_0s_decisions_recorded(world):
    _, _, seen = world
    heuristic = seen[0]["heuristic"]
    assert heuristic["updates"] == UPDATES and seen[1]["heuristic"] == heuristic  # no RanksDiverged on either
    run_dir = Path(heuristic["run_dir"])
    kinds = [json.loads(line)["kind"] for line in (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()]
    assert "applied" in kinds, kinds
    assert [p.name for p in (run_dir / "training" / "opal" / "decisions").iterdir()]
    assert heuristic["final_model_sha256"] != seen[0]["plain"]["final_model_sha256"]  # its program did change

