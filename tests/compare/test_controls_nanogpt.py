"""The nanoGPT-like case of issue 26, as a test: a char-level GPT (tests/tasks/char_gpt_task.py), AdamW against
the heuristic agent on two seeds, and no anneal-end arm. The agent's only act on every seed is ``ANNEAL_START None
-> 0.8`` past half the budget, which is the fixed ``anneal-end`` schedule: compare must say so and name the missing
control arm; ``opalctl control`` writes the post-hoc control lock (the seed-1 decisions replayed on seed 2, and the
fixed anneal-end arm), its runs go through ``grid``, and ``compare`` of the parent shows them marked post-hoc. The
fixed arm, the replay and the agent arm end with the same weights on the same seed. A control lock whose parent is
not the lock it names, or whose budget is not the parent's, is refused.

Two seeds carry every property (the replay on another seed than its source's, a paired comparison); the parent's
runs are made in this process and the CLI commands but ``grid`` are called in it (``call_cli``): the control's grid
is the one run of ``opalctl`` as a user types it that the case is about."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from opalctl.compare.controls import run_equivalence
from tests.support.cli import call_cli, run_cli

TASK_FILE = Path(__file__).resolve().parents[1] / "tasks" / "char_gpt_task.py"
OPTIMIZER = "{name: AdamW, lr: 0.003, betas: [0.9, 0.99], weight_decay: 0.1}"
PROTOCOL = f"""\
name: baby
task: {{entry: char_gpt_task:CharGPT}}
data: {{train: data/train.npz, val: data/val.npz}}
parents: parents/seed-{{seed}}.pt
seeds: [1, 2]
budget: {{clock: updates, amount: 150}}
training: {{batch_size: 16}}
arms:
  adamw: {{optimizer: {OPTIMIZER}}}
  agent: {{optimizer: {OPTIMIZER}, agent: {{backend: heuristic}}}}
selection:
  denominators: [val.total]
  nonincreasing: [val.loss]
"""


class Project:
    def __init__(self, folder: Path):
        self.folder = folder
        self.env = {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}

    def cli(self, *args, folder: Path | None = None):
        """``opalctl ARGS`` in this process (``call_cli``), in ``folder`` (the project's by default)."""
        with contextlib.chdir(folder or self.folder):
            return call_cli(*args)

    def grid(self, lock: str):
        """``opalctl grid LOCK`` in a child process, as a user types it (its runs are children either way)."""
        done = run_cli("grid", lock, "--jobs", "2", cwd=self.folder, env=self.env, timeout=600)
        assert done.code == 0, done.output
        return done

    def ok(self, *args, folder: Path | None = None):
        done = self.cli(*args, folder=folder)
        assert done.code == 0, done.output
        return done

    def runs_of(self, lock_name: str) -> Path:
        """The runs folder of the lock named ``lock_name`` (NAME-SHA12): by the name's whole form, since "baby-*"
        matches the control lock's folder (baby-control-...) too."""
        found = [p for p in (self.folder / "runs").iterdir()
                 if p.name.rpartition("-")[0] == lock_name and len(p.name.rpartition("-")[2]) == 12]
        assert len(found) == 1, found
        return found[0]

    def report(self, lock_name: str, arm: str, seed: int) -> dict:
        return json.loads((self.runs_of(lock_name) / arm / f"seed-{seed}" / "report.json").read_text())


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The project, frozen, its runs made once (in this process); then the post-hoc control made and its grid run
    once. The task module is on this process's path for the module's tests (freeze and the runs import it)."""
    from opalctl.driver.run import run

    folder = tmp_path_factory.mktemp("baby-gpt")
    shutil.copy(TASK_FILE, folder / TASK_FILE.name)
    project = Project(folder)
    sys.path.insert(0, str(folder))
    try:
        import char_gpt_task

        char_gpt_task.write_project(folder, seeds=(1, 2))
        (folder / "baby.yaml").write_text(PROTOCOL)
        project.ok("freeze", "baby.yaml")
        for arm in ("adamw", "agent"):
            for seed in (1, 2):
                run(folder / "baby.lock.json", arm, seed, runs_dir=folder / "runs")
        project.before = project.ok("compare", "baby.lock.json", "--json").json()
        project.made = project.ok("control", "baby.lock.json", "--arm", "agent", "--from-seed", "1", "--json").json()
        project.grid(project.made["lock"])
        project.after = project.ok("compare", "baby.lock.json", "--json").json()
        project.text = project.ok("compare", "baby.lock.json").stdout
        yield project
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("char_gpt_task", None)


def test_compare_names_the_agents_programs_as_the_anneal_end_schedule_and_the_missing_arm(project):
    (controls,) = project.before["controls"]
    assert [(s["seed"], s["schedule"], s["scale"], s["applied"]) for s in controls["seeds"]] == [
        (1, "anneal-end", 1.0, 1), (2, "anneal-end", 1.0, 1)]
    assert controls["control_arm"] is None and controls["missing_arm"]["name"] == "adamw-anneal-end"
    assert controls["sentence"] == (
        "agent's applied programs equal fixed schedule `anneal-end` on all 2 seeds; no such arm in this lock: add "
        "one, or run the post-hoc control (`opalctl control LOCK --arm agent`)")
    agent = next(a for a in project.before["arms"] if a["arm"] == "agent")
    assert agent["paired"]["val.loss"]["verdict"].endswith(
        " But its applied programs equal the fixed schedule `anneal-end`, and no control arm ran it (see controls).")


def test_the_control_lock_names_its_parent_and_is_marked_post_hoc(project):
    made = project.made
    assert made["arms"] == ["agent-replay-s1", "adamw-anneal-end"] and made["seeds"] == [2]
    lock = json.loads(Path(project.folder / made["lock"]).read_text())
    parent_sha = project.before["lock_sha256"]
    assert lock["protocol"]["control"] == {
        "post_hoc": True, "parent_lock": "baby.lock.json", "parent_sha256": parent_sha, "arm": "agent",
        "from_seed": 1, "source_run": str((project.folder / "runs" / f"baby-{parent_sha[:12]}" / "agent" /
                                           "seed-1").resolve())}
    assert lock["protocol"]["budget"] == json.loads((project.folder / "baby.lock.json").read_text())[
        "protocol"]["budget"]
    project.ok("verify", made["lock"])


def test_compare_of_the_parent_shows_the_control_runs_marked_post_hoc(project):
    rows = {a["arm"]: a for a in project.after["arms"]}
    assert [(name, rows[name]["post_hoc"], rows[name]["seeds"]) for name in rows] == [
        ("adamw", False, [1, 2]), ("agent", False, [1, 2]), ("adamw-anneal-end", True, [2]),
        ("agent-replay-s1", True, [2])]  # a lock's arms are in its canonical (sorted) order
    assert "[post-hoc control, added after the fact, not pre-registered]" in \
        rows["agent-replay-s1"]["paired"]["val.loss"]["verdict"]
    (controls,) = project.after["controls"]
    assert controls["control_arm"] == "adamw-anneal-end" and controls["control_in"] == "post-hoc"
    assert "agent-replay-s1 (post-hoc)" in project.text and "adamw-anneal-end (post-hoc)" in project.text
    assert ("controls: agent's applied programs equal fixed schedule `anneal-end` on all 2 seeds; control arm "
            "`adamw-anneal-end` added after the fact") in project.text


def test_the_fixed_arm_the_replay_and_the_agent_end_with_the_same_weights(project):
    agent = project.report("baby", "agent", 2)["final_model_sha256"]
    assert project.report("baby-control-agent-s1", "adamw-anneal-end", 2)["final_model_sha256"] == agent
    assert project.report("baby-control-agent-s1", "agent-replay-s1", 2)["final_model_sha256"] == agent
    assert project.report("baby", "adamw", 2)["final_model_sha256"] != project.report("baby", "agent", 2)[
        "final_model_sha256"]


def test_a_scale_applied_mid_run_is_not_reducible(project, tmp_path):
    """The agent's own records with its applied version's LR_SCALE set to 0.5: a constant scale only from the
    update it was applied, which no fixed schedule is."""
    runs = project.runs_of("baby")
    copy = tmp_path / "seed-1"
    shutil.copytree(runs / "agent" / "seed-1", copy)
    program = copy / "training" / "opal" / "programs" / "v001" / "updater.py"
    program.write_text(program.read_text().replace("LR_SCALE = 1.0", "LR_SCALE = 0.5"))
    found = run_equivalence(copy, 1, "constant", 150.0)
    assert found.schedule is None
    assert found.reason.startswith("LR_SCALE 0.5, CLIP None, ANNEAL_START 0.8 from update ")
    assert "no built-in schedule changes it" in found.reason
    program.write_text(program.read_text().replace("factor = LR_SCALE\n", "factor = LR_SCALE * 1.0\n"))
    assert run_equivalence(copy, 1, "constant", 150.0).reason == (
        "version 1: its updater.py is not the starting updater with other settings (its code was changed)")


def test_a_control_whose_parent_changed_or_whose_budget_differs_is_refused(project, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(project.folder, folder, ignore=shutil.ignore_patterns("runs"))
    control = project.made["lock"]
    # the parent refrozen: the replaced lock is kept beside it, so the control still finds its parent
    (folder / "baby.yaml").write_text(PROTOCOL.replace("batch_size: 16", "batch_size: 16, checkpoint_every: 0.2"))
    project.ok("freeze", "baby.yaml", "--force", folder=folder)
    project.ok("verify", control, folder=folder)
    for kept in folder.glob("baby.lock.*.json"):
        kept.unlink()
    refused = project.cli("verify", control, folder=folder)
    assert refused.code == 3, refused.output
    (line,) = refused.stderr.strip().splitlines()
    assert f"control lock {control} was made for parent lock baby.lock.json with sha256 " in line
    assert "make the control again with `opalctl control`" in line
    # a control whose budget is not the parent's is refused (freeze it by hand from an edited protocol)
    shutil.copy(project.folder / "baby.lock.json", folder / "baby.lock.json")
    edited = (folder / control.replace(".lock.json", ".yaml"))
    edited.write_text(edited.read_text().replace("amount: 150.0", "amount: 300.0"))
    project.ok("freeze", edited.name, "--force", folder=folder)
    refused = project.cli("verify", control, folder=folder)
    assert refused.code == 2, refused.output
    assert "its budget differs from its parent's" in refused.stderr
    # nor one that replays another run than the one it names
    edited.write_text(edited.read_text().replace("amount: 300.0", "amount: 150.0").replace(
        "/agent/seed-1", "/agent/seed-2"))
    project.ok("freeze", edited.name, "--force", folder=folder)
    refused = project.cli("verify", control, folder=folder)
    assert refused.code == 2, refused.output
    assert "is not the run of arm 'agent' on seed 1 of its parent" in refused.stderr
    # nor one whose arms group the parameters otherwise than the arm it controls
    edited.write_text(edited.read_text().replace("/agent/seed-2", "/agent/seed-1"))
    protocol = yaml.safe_load(edited.read_text())
    for spec in protocol["arms"].values():
        spec["groups"] = [{"match": ["ndim<2"], "weight_decay": 0.0}]
    edited.write_text(yaml.safe_dump(protocol))
    project.ok("freeze", edited.name, "--force", folder=folder)
    refused = project.cli("verify", control, folder=folder)
    assert refused.code == 2, refused.output
    assert "has groups [{" in refused.stderr and "a control gets the same compute" in refused.stderr


@pytest.mark.parametrize(("args", "said"), [
    (("--arm", "adamw"), "--arm 'adamw' of baby.lock.json has no agent: a control replays an agent arm's decisions"),
    (("--arm", "nope"), "--arm 'nope' is not an arm of baby.lock.json (adamw, agent)"),
    (("--arm", "agent", "--from-seed", "7"), "--from-seed 7: arm 'agent' has no finished run on that seed"),
])
def test_a_control_that_cannot_be_made_is_one_sentence(project, args, said):
    refused = project.cli("control", "baby.lock.json", *args)
    assert refused.code == 2 and refused.stdout == "", refused.output
    (line,) = refused.stderr.strip().splitlines()
    assert said in line
