"""The formal run end to end, in this process: the budget loop under a scripted clock, promotion, and refusals.

Every run is a real ``opalctl.driver.run.run`` on the built-in digits task; the
expectations are computed here from the scripted charges and from the stage records, not taken from the driver.
"""

from __future__ import annotations

import os
import shutil

import pytest

from opalctl import checkpoints
from opalctl.driver.budget import Clock
from opalctl.driver.promotion import DenominatorMismatch
from opalctl.driver.records import read_steps
from tests import support
from tests.support.cli import call_cli

FRACTIONS = [0.25, 0.5, 0.75, 1.0]


class FakeClock(Clock):
    """Charges scripted amounts, one per update; checks that nothing is written to the run folder while timed."""

    name = "fake"

    def __init__(self, charges, watch=None):
        self.charges = list(charges)
        self.given = []
        self.token = None
        self.watch = watch

    def _files(self):
        if self.watch is None or not self.watch.exists():
            return None
        return {(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in self.watch.iterdir()}

    def start(self):
        assert self.token is None, "start() called twice without stop()"
        self.token = (object(), self._files())
        return self.token

    def stop(self, token):
        assert token is self.token, "stop() got another interval's token"
        self.token = None
        assert self._files() == token[1], "a file of the run folder changed inside a timed interval"
        charge = self.charges.pop(0)
        self.given.append(charge)
        return charge


def first_updates(charges, total, fractions):
    """Stage index -> the first update whose cumulative charge reaches fraction * total (charges are dyadic)."""
    used, out, stage = 0.0, {}, 0
    for update, charge in enumerate(charges, start=1):
        used += charge
        while stage < len(fractions) and used >= fractions[stage] * total:
            out[stage] = update
            stage += 1
        if used >= total:
            return out, update, used
    raise AssertionError("the scripted charges never reach the budget")


def fake_clock_run(project, charges, *, arm="adamw", selection=None, spare=5):
    lock = project.freeze(budget={"clock": "cpu", "amount": 1.0, "fractions": FRACTIONS},
                          arms={"adamw": support.ADAMW, "high": support.ADAMW_HIGH},
                          selection=selection or support.LENIENT)
    clocks, names = [], []

    def factory(name):
        names.append(name)
        clocks.append(FakeClock(list(charges) + [0.5] * spare, watch=project.run_dir(arm, 1)))
        return clocks[-1]

    report = project.run(arm, 1, clock_factory=factory)
    assert names == ["cpu"], "the clock is made once, from the protocol's clock name"
    return lock, report, clocks[0]


def load_stage_checkpoint(run_dir, stage):
    return checkpoints.load(run_dir / stage["checkpoint"]["file"])


# ------------------------------------------------------------------------------------------------------------
# 1. the budget loop under a scripted clock

def test_boundaries_land_at_exact_fractions_and_a_slow_update_records_two_stages(project):
    # cumulative: .0625 .125 .1875 .25 | .3125 .8125 (crosses .5 and .75) | .875 .9375 1.1875 (overshoot .1875)
    charges = [0.0625] * 5 + [0.5, 0.0625, 0.0625, 0.25]
    expected, last_update, used = first_updates(charges, 1.0, FRACTIONS)
    assert expected == {0: 4, 1: 6, 2: 6, 3: 9} and last_update == 9 and used == 1.1875

    _, report, clock = fake_clock_run(project, charges, arm="high")
    run_dir = project.run_dir("high", 1)
    assert clock.given == charges, "exactly one charge per update, and none after the budget is spent"
    assert clock.token is None

    stages = support.stage_files(run_dir)
    assert [s["stage"] for s in stages] == [1, 2, 3, 4]
    assert [s["fraction"] for s in stages] == FRACTIONS
    assert {i: s["update"] for i, s in enumerate(stages)} == expected
    cumulative = [sum(charges[:n]) for n in range(len(charges) + 1)]
    for stage in stages:
        assert stage["budget_used"] == cumulative[stage["update"]]
        assert stage["examples"] == 64 * stage["update"]
        payload = load_stage_checkpoint(run_dir, stage)
        assert payload["model_sha256"] == stage["checkpoint"]["model_sha256"]
        assert payload["meta"] == {"stage": stage["stage"], "update": stage["update"]}
        assert support.sha256_of(run_dir / stage["checkpoint"]["file"]) == stage["checkpoint"]["sha256"]

    one, two, three, four = stages
    # the slow update: both boundaries are recorded at the same state
    assert two["update"] == three["update"] == 6
    assert two["checkpoint"]["model_sha256"] == three["checkpoint"]["model_sha256"]
    assert two["metrics"] == three["metrics"] and two["budget_used"] == three["budget_used"] == 0.8125
    assert two["shared_state_with"] == [3] and three["shared_state_with"] == [2]
    assert one["shared_state_with"] == [] and four["shared_state_with"] == []
    # ... and the other stages really are other states
    assert len({one["checkpoint"]["model_sha256"], two["checkpoint"]["model_sha256"],
                four["checkpoint"]["model_sha256"]}) == 3
    # stage 3 holds the very state stage 2 holds, so it cannot improve on it: an exact tie keeps stage 2
    assert [s["promoted"] for s in stages] == [True, True, False, True]
    assert three["incumbent_before"] == three["incumbent_after"] == 2
    assert len(three["decision"]["reasons"]) == 1 and "tie" in three["decision"]["reasons"][0]

    budget = report["budget"]
    assert report["updates"] == 9 and report["examples_seen"] == 9 * 64
    assert budget["total"] == 1.0 and budget["used"] == 1.1875
    assert budget["overshoot"] == 1.1875 - 1.0 == charges[-1] - (1.0 - cumulative[8])
    assert any("overshot" in line for line in report["limitations"])
    assert support.read(run_dir / "last.json")["model_sha256"] == four["checkpoint"]["model_sha256"] \
        == report["final_model_sha256"]
    assert not (run_dir / "training" / "resume.pt").exists()

    steps = list(read_steps(run_dir / "training" / "steps.jsonl.gz"))
    assert [s["update"] for s in steps] == list(range(1, 10))
    assert [s["charge"] for s in steps] == charges
    assert [s["used"] for s in steps] == cumulative[1:]


def test_one_slow_update_that_crosses_every_fraction_records_every_stage_at_that_state(project):
    charges = [0.0625, 0.0625, 0.0625, 3.0]
    _, report, clock = fake_clock_run(project, charges, arm="high")
    run_dir = project.run_dir("high", 1)
    assert clock.given == charges
    stages = support.stage_files(run_dir)
    assert [s["update"] for s in stages] == [4, 4, 4, 4]
    assert len({s["checkpoint"]["model_sha256"] for s in stages}) == 1
    assert all(s["metrics"] == stages[0]["metrics"] for s in stages)
    assert [s["shared_state_with"] for s in stages] == [[2, 3, 4], [1, 3, 4], [1, 2, 4], [1, 2, 3]]
    # the first is promoted over the anchor; the other three are the same state, an exact tie, so stage 1 stays
    assert [s["promoted"] for s in stages] == [True, False, False, False]
    assert all("tie" in s["decision"]["reasons"][0] for s in stages[1:])
    assert support.read(run_dir / "selected.json")["stage"] == 1
    assert report["updates"] == 4 and report["budget"]["used"] == 3.1875 and report["budget"]["overshoot"] == 2.1875
    assert [s["charge"] for s in read_steps(run_dir / "training" / "steps.jsonl.gz")] == charges


def test_updates_clock_counts_whole_updates(finished_runs):
    run_dir = finished_runs["base"] / "adamw" / "seed-2"  # the session's finished runs: 60 updates (read-only)
    report = support.read(run_dir / "report.json")
    assert [s["update"] for s in support.stage_files(run_dir)] == [15, 30, 45, 60]
    assert report["updates"] == 60 and report["budget"]["overshoot"] == 0.0
    steps = list(read_steps(run_dir / "training" / "steps.jsonl.gz"))
    assert [s["update"] for s in steps] == list(range(1, 61)) and {s["charge"] for s in steps} == {1.0}
    assert steps[-1]["seen"] == report["rows_digest"]
    start = support.read(run_dir / "start.json")
    assert start["seed"] == 2 and start["arm"] == "adamw"
    assert start["lock_sha256"] == support.sha256_of(finished_runs["lock"])
    initial = checkpoints.load(run_dir / "initial.pt")
    assert initial["model_sha256"] == start["initial"]["model_sha256"]
    anchor = support.read(finished_runs["base"] / "anchors" / "seed-2" / "anchor.json")
    assert anchor["model_sha256"] == start["anchor"]["model_sha256"] == initial["model_sha256"]
    assert report["anchor_metrics"] == anchor["metrics"]


REUSING_TASK = """
import numpy as np

from opalctl.tasks.digits import Digits, DigitsSampler


class ReusingSampler(DigitsSampler):
    # hands every batch over with the same ids array, rewritten in place: the run must copy the ids it keeps
    fresh_ids = False

    def next_batch(self):
        batch = super().next_batch()
        if not hasattr(self, "buffer"):
            self.buffer = np.empty_like(batch.ids)
        self.buffer[:] = batch.ids
        batch.ids = self.buffer
        return batch


class ReusingDigits(Digits):
    def sampler(self, train, seed, batch_size, device="cpu"):
        return ReusingSampler(train, seed, batch_size, self.config.replay_share, device)
"""


@pytest.mark.parametrize("reusing", [False, True], ids=["fresh ids kept", "reused ids copied"])
def test_each_line_digests_the_rows_its_update_trained_on(request, reusing):
    import hashlib

    import numpy as np
    import yaml

    from opalctl.tasks.digits import Digits

    if reusing:
        project = request.getfixturevalue("project")
        entry = project.task_module(REUSING_TASK, "ReusingDigits")
        project.freeze(entry=entry, budget={"clock": "updates", "amount": 30}, arms={"adamw": support.ADAMW})
        project.run("adamw", 1)
        run_dir, folder = project.run_dir("adamw", 1), project.folder
    else:  # the built-in sampler: the session's finished run of adamw on seed 1 (read-only)
        finished = request.getfixturevalue("finished_runs")
        run_dir, folder = finished["base"] / "adamw" / "seed-1", finished["project"]
    steps = list(read_steps(run_dir / "training" / "steps.jsonl.gz"))
    # the same batches, drawn again from a fresh built-in sampler with the run's seed and batch size
    protocol = yaml.safe_load((folder / "digits.yaml").read_text())
    task = Digits(protocol["task"]["config"])
    train = task.load({"train": folder / protocol["data"]["train"]})["train"]
    sampler = task.sampler(train, 1, protocol["training"]["batch_size"])
    seen = "0" * 32
    for line in steps:
        rows = hashlib.sha256(np.asarray(sampler.next_batch().ids, dtype=np.int64).tobytes()).hexdigest()[:16]
        seen = hashlib.sha256(f"{seen}:{rows}".encode()).hexdigest()[:32]
        assert (line["rows"], line["seen"]) == (rows, seen), f"update {line['update']}"
    assert len(steps) == (30 if reusing else 60) and all(isinstance(line["loss"], float) for line in steps)


# ------------------------------------------------------------------------------------------------------------
# 2. promotion through real runs

STRICT = {
    "denominators": ["selection.total", "retention.total"],
    "floors": {"retention.correct": 0},
    "nondecreasing": ["retention.correct"],
    "nonincreasing": ["selection.correct"],
    "improve_any": ["retention.correct"],
}


def failing_rules(candidate, incumbent, anchor, policy):
    """This test's own reading of the promotion rules: the (rule, metric) pairs a candidate fails."""
    lower = set(policy.get("nonincreasing", []))
    out = [("floors", m) for m, tol in policy.get("floors", {}).items() if not candidate[m] >= anchor[m] - tol]
    out += [("nondecreasing", m) for m in policy.get("nondecreasing", []) if not candidate[m] >= incumbent[m]]
    out += [("nonincreasing", m) for m in policy.get("nonincreasing", []) if not candidate[m] <= incumbent[m]]
    improve = policy.get("improve_any") or policy.get("nondecreasing", []) + policy.get("nonincreasing", [])
    if not any((candidate[m] < incumbent[m]) if m in lower else (candidate[m] > incumbent[m]) for m in improve):
        out.append(("improve_any", None))
    return out


def walk(stages, anchor, policy):
    """Replay the policy over the stage metrics: (expected promoted flags, expected failures per stage)."""
    incumbent, promoted, failures = anchor, [], []
    for stage in stages:
        failed = failing_rules(stage["metrics"], incumbent, anchor, policy)
        promoted.append(not failed)
        failures.append(failed)
        if not failed:
            incumbent = stage["metrics"]
    return promoted, failures


def test_anchor_is_selected_and_flagged_when_no_stage_qualifies(project):
    lock = project.freeze(budget={"clock": "updates", "amount": 60}, arms={"high": support.ADAMW_HIGH},
                          selection=STRICT)
    report = project.run("high", 1)
    run_dir = project.run_dir("high", 1)
    anchor = support.read(project.base / "anchors" / "seed-1" / "anchor.json")
    stages = support.stage_files(run_dir)
    promoted, failures = walk(stages, anchor["metrics"], STRICT)
    assert promoted == [False] * 4
    for stage, failed in zip(stages, failures, strict=True):
        decision = stage["decision"]
        assert stage["promoted"] is decision["promoted"] is False
        assert stage["incumbent_before"] == stage["incumbent_after"] == "anchor"
        # every reason is recorded, not just the first: here all four rules fail at every stage
        assert len(failed) == 4
        assert len(decision["reasons"]) == len(failed)
        for (_rule, metric), reason in zip(failed, decision["reasons"], strict=True):
            assert metric is None or metric in reason
        failed_checks = {(c["rule"], c["metric"]) for c in decision["checks"] if not c["passed"]}
        assert {(r, m) for r, m in failed if m} <= failed_checks
        assert {c["metric"] for c in decision["checks"] if c["rule"] == "denominators"} == set(STRICT["denominators"])

    selected = support.read(run_dir / "selected.json")
    parent = support.read(lock)["records"]["parent.seed-1"]
    assert selected["source"] == "anchor" and selected["flagged"] is True and selected["stage"] is None
    assert selected["checkpoint"]["sha256"] == parent["sha256"]
    assert selected["checkpoint"]["model_sha256"] == anchor["model_sha256"]
    assert selected["metrics"] == anchor["metrics"]
    assert report["selected"] == {"source": "anchor", "stage": None, "flagged": True}
    assert report["promoted_stages"] == []
    assert any("anchor" in line for line in report["limitations"])
    # training went on to the full budget after every rejection
    assert report["updates"] == 60 and [s["update"] for s in stages] == [15, 30, 45, 60]


MIXED = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 12},
         "improve_any": ["selection.correct"]}


def test_a_stage_is_promoted_when_the_rules_pass_and_floors_stay_with_the_anchor(finished_runs):
    # the session's finished runs (read-only) are adamw's 60 updates under MIXED
    lock = support.read(finished_runs["lock"])
    assert lock["protocol"]["selection"] == {**lock["protocol"]["selection"], **MIXED}
    run_dir = finished_runs["base"] / "adamw" / "seed-1"
    report = support.read(run_dir / "report.json")
    anchor = support.read(finished_runs["base"] / "anchors" / "seed-1" / "anchor.json")["metrics"]
    stages = support.stage_files(run_dir)
    promoted, failures = walk(stages, anchor, MIXED)
    assert [s["promoted"] for s in stages] == promoted
    assert any(promoted) and not all(promoted), "this protocol is meant to promote some stages and refuse others"
    incumbent = "anchor"
    for stage, failed in zip(stages, failures, strict=True):
        assert stage["incumbent_before"] == incumbent
        incumbent = stage["stage"] if stage["promoted"] else incumbent
        assert stage["incumbent_after"] == incumbent
        assert len(stage["decision"]["reasons"]) == len(failed)
        assert (stage["decision"]["reasons"] == []) == stage["promoted"]

    chosen = max(i for i, p in enumerate(promoted) if p)
    best = stages[chosen]
    selected = support.read(run_dir / "selected.json")
    assert selected["source"] == "stage" and selected["flagged"] is False and selected["stage"] == best["stage"]
    assert selected["metrics"] == best["metrics"]
    assert selected["checkpoint"] == {k: best["checkpoint"][k] for k in ("file", "sha256", "model_sha256")}
    assert support.sha256_of(run_dir / selected["checkpoint"]["file"]) == selected["checkpoint"]["sha256"]
    assert checkpoints.load(run_dir / selected["checkpoint"]["file"])["model_sha256"] == \
        selected["checkpoint"]["model_sha256"]
    assert report["promoted_stages"] == [s["stage"] for s in stages if s["promoted"]]
    assert report["selected"] == {"source": "stage", "stage": best["stage"], "flagged": False}


SHIFTING_TASK = '''
from opalctl.tasks.digits import Digits


class ShiftingDigits(Digits):
    """Evaluates on one more row each time it is asked (a broken task: its denominators drift)."""

    calls = 0

    def evaluate(self, model, rows):
        ShiftingDigits.calls += 1
        metrics = super().evaluate(model, rows)
        metrics["total"] += ShiftingDigits.calls
        return metrics
'''


def test_mismatched_denominators_fail_the_run_loudly(project):
    entry = project.task_module(SHIFTING_TASK, "ShiftingDigits")
    project.freeze(entry=entry, budget={"clock": "updates", "amount": 20}, arms={"adamw": support.ADAMW},
                   selection=MIXED)
    code, out, err = call_cli(*project.run_args("adamw", 1))
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opalctl: error: ")
    assert "denominator" in lines[0] and "selection.total" in lines[0]
    run_dir = project.run_dir("adamw", 1)
    assert not list(run_dir.glob("stage-*.json")), "no decision may be recorded on mismatched evaluations"
    assert not (run_dir / "selected.json").exists() and not (run_dir / "report.json").exists()

    with pytest.raises(DenominatorMismatch, match="denominator"):
        project.run("adamw", 2)


# ------------------------------------------------------------------------------------------------------------
# 3. refusals: a run folder is never overwritten, resume needs a run to continue, frozen inputs must match

def test_a_finished_run_is_never_overwritten(pausing, pausing_made):
    project = pausing
    shutil.copytree(pausing_made / "reference", project.runs, symlinks=True)  # the session's finished run, copied
    before = support.snapshot(project.runs)
    run_dir = project.run_dir("adamw", 1)

    child = project.process(project.run_args("adamw", 1))
    assert child.returncode == 2, child.stderr
    assert child.stdout == ""
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1, child.stderr
    assert lines[0].startswith("opalctl: error: ") and str(run_dir) in lines[0] and "overwritten" in lines[0]
    assert support.snapshot(project.runs) == before

    code, out, err = call_cli(*project.run_args("adamw", 1, "--resume"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "already finished" in err and str(run_dir) in err
    assert support.snapshot(project.runs) == before


def test_resume_without_a_run_is_refused_and_leaves_nothing_behind(project):
    project.freeze(budget={"clock": "updates", "amount": 20}, arms={"adamw": support.ADAMW})
    code, out, err = call_cli(*project.run_args("adamw", 2, "--resume"))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no run to resume" in lines[0] and str(project.run_dir("adamw", 2)) in lines[0]
    assert not project.run_dir("adamw", 2).exists()
    # ... so the run can then be started normally
    assert project.run("adamw", 2)["updates"] == 20


def test_a_changed_data_file_stops_the_run_before_any_work(project):
    project.freeze(budget={"clock": "updates", "amount": 20}, arms={"adamw": support.ADAMW})
    data = project.folder / "data" / "digits" / "selection.npz"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    code, out, err = call_cli(*project.run_args("adamw", 1))
    assert code == 3 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "data/digits/selection.npz" in lines[0] and "data.selection" in lines[0]
    assert not project.runs.exists()


@pytest.mark.parametrize("arm, seed, words", [("nope", 1, "no arm 'nope'"), ("adamw", 9, "seed 9")])
def test_an_unknown_arm_or_seed_is_refused(project, arm, seed, words):
    project.freeze(budget={"clock": "updates", "amount": 20}, arms={"adamw": support.ADAMW})
    code, out, err = call_cli(*project.run_args(arm, seed))
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1
    assert not project.runs.exists()


HELD_BY_A_HELPER = """
import fcntl, subprocess, sys
handle = open(sys.argv[1], "a+")
fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
# a child inherits the lock and holds it a while after its taker is gone, as a killed run's steps helper does
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"], pass_fds=[handle.fileno()])
"""


def test_a_folder_locked_by_a_live_process_is_refused_at_once_and_one_a_killed_runs_helper_holds_is_waited_for(
        project, monkeypatch):
    import fcntl
    import subprocess
    import sys

    from opalctl.driver import run as run_module
    from opalctl.errors import BadInput

    project.freeze(budget={"clock": "updates", "amount": 8}, arms={"adamw": support.ADAMW})
    run_dir = project.run_dir("adamw", 1)
    lock = run_dir.parent / ".seed-1.lock"
    run_dir.parent.mkdir(parents=True)
    with open(lock, "a+") as holder:  # a live process holds it (this one; flock locks are per open file)
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        with pytest.raises(BadInput, match=rf"another opalctl process \(pid {os.getpid()}\) is running .* now; "
                                           r"wait for it to finish"):
            project.run("adamw", 1)
    assert not run_dir.exists()
    subprocess.run([sys.executable, "-c", HELD_BY_A_HELPER, str(lock)], check=True)
    monkeypatch.setattr(run_module, "LOCK_WAIT_SECONDS", 0.2)
    with pytest.raises(BadInput, match=r"another opalctl process \(pid \d+\) is running .* now; wait for it to finish"):
        project.run("adamw", 1)
    # a lock let go within the wait is taken
    monkeypatch.setattr(run_module, "LOCK_WAIT_SECONDS", 30.0)
    assert project.run("adamw", 1)["updates"] == 8
