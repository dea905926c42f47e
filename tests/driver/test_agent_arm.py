"""Agent arms in formal runs: an arm whose optimizer is wrapped by ``opalctl.opal.wrap``.

The protocol is the digits project on an ``updates`` clock of ``AMOUNT`` updates with a resume checkpoint every
5 % of the budget, and two arms with the same AdamW settings: ``adamw`` (plain) and ``agent`` (the heuristic
agent, 8 decisions). With this budget the heuristic changes the program at least once (every test that relies
on it checks the ``applied`` event first), so a run's records hold both kept and applied decisions.

What is shown here:

- the arm runs through the real command line and leaves the agent's records (events, programs, decisions);
- two runs of it end with the same weights, events and programs, and until the agent changes something it is
  bit for bit the plain arm (the starting program calls the user's optimizer);
- killed with SIGKILL anywhere (mid-update before any change, while the agent decides, after a new program was
  applied, during and after its trial) and resumed with ``--resume``, it ends exactly where an uninterrupted
  run ends, with the same program versions and events (apart from ``resumed`` events and timing);
- the agent's waiting is never charged to the budget clock;
- ``compare`` and ``show`` report the agent's figures and decisions;
- LLM backends are refused by ``run`` until they land.

The runs every test reads are made once for the module (``agent_runs``, on the crash task; the fake clock's pair,
``fake_clock``); each crash test kills and resumes runs in its own copy of the project.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time

import pytest

from opalctl import checkpoints
from opalctl.driver.budget import Clock
from opalctl.driver.records import read_steps
from tests import support
from tests.support.cli import call_cli

AMOUNT = 300          # updates; checkpoint_every 0.05: a resume checkpoint every 15 updates
EVERY = AMOUNT // 20
KILLED = -signal.SIGKILL
ADAMW = {"optimizer": {"name": "AdamW", "lr": 1.0e-3, "weight_decay": 0.01}}
AGENT = {**ADAMW, "agent": {"backend": "heuristic", "decisions": 8}}
ARMS = {"adamw": ADAMW, "agent": AGENT}
SELECTION = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 10},
             "improve_any": ["selection.correct"]}
# fields of the agent's records that measure time, and so differ between two runs of the same arithmetic
TIMING = {"seconds", "waited_seconds", "waiting_seconds", "agent_seconds", "agent_code_seconds"}
TIMING_LINE = re.compile(r"^updater step: .* ms on average; analysis: .* ms per call\.$", re.MULTILINE)

# The task of the crash tests: the digits task with a little noise from torch's global generator on every batch
# (a resume that failed to restore the RNG would not end with the same weights), killing its own process at the
# N-th ``loss`` or ``evaluate`` call, or right after the N-th answer of the heuristic agent (the workspace then
# holds the edited program, but the optimizer has not applied it yet).
CRASH_TASK = '''
import os
import signal

import torch
import torch.nn.functional as F

from opalctl.opal.decisions import HostedLine
from opalctl.tasks.digits import Digits

CALLS = {"loss": 0, "evaluate": 0, "decide": 0}


def _maybe_die(kind):
    CALLS[kind] += 1
    if os.environ.get(f"KILL_{kind.upper()}_AT") == str(CALLS[kind]):
        os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("KILL_DECIDE_AT"):  # only in the child that is to die so
    _call = HostedLine.call  # the heuristic answers in the agent host; this process dies once it has the answer

    def _call_then_maybe_die(self, number, message, facts, files):
        answer = _call(self, number, message, facts, files)
        _maybe_die("decide")
        return answer

    HostedLine.call = _call_then_maybe_die


class CrashDigits(Digits):
    def loss(self, model, batch):
        _maybe_die("loss")
        noisy = batch.inputs + 0.05 * torch.randn_like(batch.inputs)
        return F.cross_entropy(model(noisy), batch.targets), {}

    def evaluate(self, model, rows):
        _maybe_die("evaluate")
        return super().evaluate(model, rows)
'''


def freeze_agent_protocol(project, *, entry=None, budget=None, arms=None):
    return project.freeze(entry=entry, budget=budget or {"clock": "updates", "amount": AMOUNT},
                          training={"checkpoint_every": 0.05}, arms=arms or ARMS, selection=SELECTION)


@pytest.fixture(scope="module")
def agent_runs(made_project, tmp_path_factory):
    """Runs made once for the module on the crash task, and only read: ``adamw`` and then ``agent`` on seeds 1 and
    2 in this process (under ``project.runs``: the agent arm finds its anchor evaluated by the plain arm), and
    ``agent`` on seed 1 once more through the command line in a child process, alone in its runs folder
    (``cli_runs``): the uninterrupted run, ``reference``, that the crash tests end like."""
    project = made_project("agent-arm")
    freeze_agent_protocol(project, entry=project.task_module(CRASH_TASK, "CrashDigits"))
    for arm in ("adamw", "agent"):
        for seed in (1, 2):
            project.run(arm, seed)
    project.cli_runs = tmp_path_factory.mktemp("agent-arm-cli")
    project.cli_result = project.process(project.run_args("agent", 1, runs=project.cli_runs))
    project.reference = project.run_dir("agent", 1, runs=project.cli_runs)
    return project


@pytest.fixture
def crash(agent_runs, tmp_path, monkeypatch):
    """The test's own copy of the project on the crash task, without runs, and the module's reference run."""
    assert agent_runs.cli_result.returncode == 0, agent_runs.cli_result.stderr[-3000:]
    assert first_applied(agent_runs.reference) is not None, "the reference run must change the program at least once"
    project = agent_runs.copy(tmp_path, monkeypatch)
    shutil.rmtree(project.runs)
    project.reference = agent_runs.reference
    return project


# -- reading the agent's records ---------------------------------------------------------------------------------

def events(run_dir):
    return [json.loads(line) for line in (run_dir / "training" / "opal" / "events.jsonl").read_text().splitlines()]


def comparable_events(run_dir):
    """The events without ``resumed`` ones and without timing fields."""
    return [{k: v for k, v in e.items() if k not in TIMING} for e in events(run_dir) if e["kind"] != "resumed"]


def first_applied(run_dir):
    return next((e for e in events(run_dir) if e["kind"] == "applied"), None)


def programs(run_dir):
    folder = run_dir / "training" / "opal" / "programs"
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def decision_records(run_dir):
    """Per decision: what the agent read (timing line removed) and what it answered, as the agent host recorded
    them, and the outcome, as the training process did."""
    out = {}
    for folder in sorted((run_dir / "training" / "opal" / "decisions").iterdir()):
        meta = json.loads((folder / "meta.json").read_text())
        host = run_dir / "agent" / "decisions" / folder.name
        out[folder.name] = (TIMING_LINE.sub("updater step: (timing)", (host / "message.md").read_text()),
                            (host / "response.md").read_text(), meta["outcome"], meta["requested_at"],
                            meta["answered_at"], meta.get("version"))
    return out


def opal_stream(run_dir, name):
    return (run_dir / "training" / "opal" / f"{name}.jsonl").read_text()


def without_timing(figures):
    return {k: v for k, v in figures.items() if k not in TIMING}


def assert_same_agent_run(got_dir, want_dir, resumes):
    """``got_dir`` (interrupted and resumed, or a second run) ends exactly where ``want_dir`` ended."""
    got, want = support.read(got_dir / "report.json"), support.read(want_dir / "report.json")
    for key in ("final_model_sha256", "rows_digest", "selected", "promoted_stages", "updates", "examples_seen",
                "anchor_metrics", "nonfinite_losses"):
        assert got[key] == want[key], key
    assert got["budget"]["used"] == want["budget"]["used"] == AMOUNT
    stage_keys = ("stage", "update", "budget_used", "metrics", "promoted")
    assert [{k: s[k] for k in stage_keys} for s in got["stages"]] == [{k: s[k] for k in stage_keys}
                                                                      for s in want["stages"]]
    assert [s["checkpoint"]["model_sha256"] for s in support.stage_files(got_dir)] == \
        [s["checkpoint"]["model_sha256"] for s in support.stage_files(want_dir)]
    assert support.read(got_dir / "selected.json") == support.read(want_dir / "selected.json")
    assert got["resumes"] == resumes

    # the agent: same figures, same final program version, same programs, events, losses, reports and decisions
    assert without_timing(got["agent"]) == without_timing(want["agent"])
    assert got["agent"]["version"] == want["agent"]["version"] >= 1
    assert programs(got_dir) == programs(want_dir)
    assert f"v{got['agent']['version']:03d}/updater.py" in programs(got_dir)
    assert comparable_events(got_dir) == comparable_events(want_dir)
    resumed = [e for e in events(got_dir) if e["kind"] == "resumed"]
    assert len(resumed) == resumes
    for name in ("losses", "reports"):
        assert opal_stream(got_dir, name) == opal_stream(want_dir, name), name
    assert decision_records(got_dir) == decision_records(want_dir)

    step_keys = ("update", "charge", "used", "loss", "rows", "seen", "lrs")
    got_steps, want_steps = list(read_steps(got_dir / "training" / "steps.jsonl.gz")), list(read_steps(want_dir / "training" / "steps.jsonl.gz"))
    assert [s["update"] for s in got_steps] == list(range(1, AMOUNT + 1))
    assert [{k: s[k] for k in step_keys} for s in got_steps] == [{k: s[k] for k in step_keys} for s in want_steps]


# -- 1. through the command line --------------------------------------------------------------------------------

def test_an_agent_arm_runs_through_the_cli_and_keeps_its_records(agent_runs):
    from opalctl.opal.optimizer import default_sources

    result = agent_runs.cli_result
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = agent_runs.run_dir("agent", 1, runs=agent_runs.cli_runs)
    report = support.read(run_dir / "report.json")
    figures = report["agent"]
    assert figures is not None
    assert figures["decisions_asked"] >= 1 and figures["decisions_applied"] >= 1
    assert figures["decisions_reverted"] == 0
    assert isinstance(figures["waiting_seconds"], float) and figures["waiting_seconds"] >= 0.0
    assert figures["cost_usd"] == 0.0, "the heuristic agent costs nothing"
    assert report["seconds"]["agent_wait_wall"] >= figures["waiting_seconds"]
    assert report["updates"] == AMOUNT and report["budget"]["used"] == AMOUNT

    # the events: start ... end, and the figures agree with them
    log = events(run_dir)
    kinds = [e["kind"] for e in log]
    assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("start") == kinds.count("end") == 1
    assert log[0]["decisions"] == 8 and log[0]["backend"]["backend"] == "heuristic"
    assert kinds.count("requested") == figures["decisions_asked"] == 8
    assert kinds.count("applied") == figures["decisions_applied"]
    assert kinds.count("kept") == figures["decisions_kept"]
    assert {k: v for k, v in log[-1].items() if k not in ("kind", "update")} == figures
    assert log[-1]["update"] == AMOUNT
    requested = [e["update"] for e in log if e["kind"] == "requested"]
    assert requested == sorted(requested) and 0 < requested[0] and requested[-1] < AMOUNT

    # programs: v000 is the shipped starting program; the final version is there; decisions 001..008
    opal = run_dir / "training" / "opal"
    assert (opal / "programs" / "v000" / "updater.py").read_text() == default_sources()["updater.py"]
    assert (opal / "programs" / f"v{figures['version']:03d}" / "updater.py").is_file()
    assert figures["version"] >= 1 and (opal / "programs" / "v001" / "updater.py").read_text() != \
        default_sources()["updater.py"]
    host = run_dir / "agent" / "decisions"  # each decision as the agent host saw it
    message = (host / "001" / "message.md").read_text()
    assert message.strip() and "# Decision 1 (scheduled)" in message
    assert sorted(p.name for p in host.iterdir()) == sorted(p.name for p in (opal / "decisions").iterdir()) == \
        [f"{n:03d}" for n in range(1, 9)]

    # one steps line per update
    steps = list(read_steps(run_dir / "training" / "steps.jsonl.gz"))
    assert [s["update"] for s in steps] == list(range(1, AMOUNT + 1))
    assert steps[-1]["seen"] == report["rows_digest"]
    assert support.read(run_dir / "start.json")["arm_config"]["agent"]["backend"] == "heuristic"
    assert not (run_dir / "training" / "resume.pt").exists()


# -- 2. determinism, and bit for bit the plain arm until the agent changes something -----------------------------

def test_two_agent_runs_end_identically_and_match_the_plain_arm_until_the_first_change(agent_runs):
    # one run in this process, one through the command line in a fresh process
    assert agent_runs.cli_result.returncode == 0, agent_runs.cli_result.stderr[-3000:]
    first = agent_runs.run_dir("agent", 1)
    second = agent_runs.run_dir("agent", 1, runs=agent_runs.cli_runs)
    applied = first_applied(first)
    assert applied is not None, "the heuristic agent must change the program at least once in this protocol"
    assert_same_agent_run(second, first, resumes=0)

    # until the new program changes the arithmetic, the agent arm is the plain arm, bit for bit
    plain = agent_runs.run_dir("adamw", 1)
    agent_steps = list(read_steps(first / "training" / "steps.jsonl.gz"))
    plain_steps = list(read_steps(plain / "training" / "steps.jsonl.gz"))
    assert [(s["loss"], s["seen"]) for s in agent_steps[:applied["update"]]] == \
        [(s["loss"], s["seen"]) for s in plain_steps[:applied["update"]]]
    agent_stages, plain_stages = support.stage_files(first), support.stage_files(plain)
    before = [i for i, s in enumerate(agent_stages) if s["update"] <= applied["update"]]
    assert before, "a stage comes before the first change"
    for i in before:
        assert agent_stages[i]["checkpoint"]["model_sha256"] == plain_stages[i]["checkpoint"]["model_sha256"]
    # ... and the change did change the training
    assert support.read(first / "report.json")["final_model_sha256"] != support.read(plain / "report.json")[
        "final_model_sha256"]
    assert [s["seen"] for s in agent_steps] == [s["seen"] for s in plain_steps], "the same rows, in the same order"


# -- 3. crash safety ---------------------------------------------------------------------------------------------

def child(project, arm="agent", *, resume, env=None, seed=1):
    args = project.run_args(arm, seed, *(["--resume"] if resume else []))
    return project.process(args, env=project.env(**(env or {})))


def assert_killed(result, run_dir):
    assert result.returncode == KILLED, f"expected SIGKILL, got {result.returncode}: {result.stderr[-2000:]}"
    assert not (run_dir / "report.json").exists() and (run_dir / "training" / "resume.pt").exists()
    steps = [s["update"] for s in read_steps(run_dir / "training" / "steps.jsonl.gz")]
    assert steps == list(range(1, len(steps) + 1)), "the steps written so far are whole and in order"


def resume_state(run_dir):
    """(the update of the resume checkpoint, the agent optimizer's state in it)."""
    payload = checkpoints.load(run_dir / "training" / "resume.pt", require_finite=False)
    return payload["meta"]["update"], payload["extra"]["optimizer"]


def finish(project, run_dir):
    """``opalctl run ... --resume`` (in this process: nothing kills it any more) until the run's end."""
    code, _, err = call_cli(*project.run_args("agent", 1, "--resume"))
    assert code == 0, err[-3000:]
    assert (run_dir / "report.json").exists() and not (run_dir / "training" / "resume.pt").exists()


def checkpoint_at_or_after(update):
    return -(-update // EVERY) * EVERY


def test_agent_arm_killed_mid_update_and_while_deciding_then_resumed(crash):
    """Killed inside an update before any change, then right after the agent answered the decision that changes
    the program (the edit is in the workspace, not yet applied); each time resumed, then run to the end."""
    log = events(crash.reference)
    applied = first_applied(crash.reference)
    run_dir = crash.run_dir("agent", 1)

    # 1. mid-update, halfway to the first change
    kill_at = max(EVERY + 3, applied["update"] // 2)
    assert checkpoint_at_or_after(kill_at) < applied["update"]
    assert_killed(child(crash, resume=False, env={"KILL_LOSS_AT": str(kill_at)}), run_dir)
    checkpoint, state = resume_state(run_dir)
    assert checkpoint == (kill_at - 1) // EVERY * EVERY and state["current"] == 0

    # 2. resumed, and killed once the agent has answered the decision that is applied in the reference run
    asked_before = sum(1 for e in log if e["kind"] == "requested" and e["update"] <= checkpoint)
    answers = applied["decision"] - asked_before
    assert answers >= 1
    assert_killed(child(crash, resume=True, env={"KILL_DECIDE_AT": str(answers)}), run_dir)
    checkpoint, state = resume_state(run_dir)
    assert checkpoint == (applied["update"] - 1) // EVERY * EVERY and state["current"] == 0
    tail = events(run_dir)[-1]
    assert (tail["kind"], tail["decision"], tail["update"]) == ("requested", applied["decision"], applied["update"])
    assert (run_dir / "agent" / "workspace" / "updater.py").read_text() == \
        (crash.reference / "training" / "opal" / "programs" / "v001" / "updater.py").read_text(), "the edit was made"

    finish(crash, run_dir)
    assert_same_agent_run(run_dir, crash.reference, resumes=2)


def test_agent_arm_killed_after_a_new_program_was_applied_then_resumed(crash):
    """Killed during the new program's trial (resuming from a checkpoint taken after it was applied), then after
    its trial passed; each time resumed, then run to the end."""
    applied = first_applied(crash.reference)
    passed = next(e for e in events(crash.reference) if e["kind"] == "trial_passed" and e["version"] == 1)
    run_dir = crash.run_dir("agent", 1)

    # 1. the first checkpoint after the change holds the new version (still in its trial when it comes first)
    after_change = checkpoint_at_or_after(applied["update"])
    kill_at = after_change + 3
    assert kill_at < AMOUNT
    assert_killed(child(crash, resume=False, env={"KILL_LOSS_AT": str(kill_at)}), run_dir)
    checkpoint, state = resume_state(run_dir)
    assert checkpoint == after_change and state["current"] == 1 and state["t"] == after_change
    assert [v["number"] for v in state["versions"]] == [0, 1]
    if after_change < passed["update"]:
        assert state["trial_left"] == passed["update"] - after_change and state["fallback"] == 0
    assert any(e["kind"] == "applied" for e in events(run_dir))

    # 2. resumed from there, and killed late in the run (the trial passed, and in the heuristic's usual change the
    #    new program's anneal has begun), just after the agent answered one more decision
    late = next(e for e in events(crash.reference) if e["kind"] == "requested"
                and e["update"] > max(passed["update"], int(0.8 * AMOUNT), after_change + EVERY))
    kill_at = late["update"] + 1
    after_trial = late["update"] // EVERY * EVERY  # the last checkpoint before the kill
    assert kill_at < AMOUNT and after_trial > max(after_change, passed["update"])
    assert_killed(child(crash, resume=True, env={"KILL_LOSS_AT": str(kill_at - after_change)}), run_dir)
    checkpoint, state = resume_state(run_dir)
    assert checkpoint == after_trial and state["current"] == state["fallback"] == 1
    assert [e["update"] for e in events(run_dir) if e["kind"] == "resumed"] == [after_change]
    assert events(run_dir)[-1]["decision"] == late["decision"], "the decision was answered before the kill"

    finish(crash, run_dir)
    assert_same_agent_run(run_dir, crash.reference, resumes=2)
    assert [e["update"] for e in events(run_dir) if e["kind"] == "resumed"] == [after_change, after_trial]


def test_an_agent_arm_ends_the_same_whether_or_not_another_arm_evaluated_the_anchor_first(agent_runs):
    # in the module's runs, adamw ran first on seed 1 and evaluated the anchor; the agent arm found it and only
    # checked it; the reference run, alone in its folder, evaluated its own
    assert (agent_runs.run_dir("adamw", 1) / "report.json").exists()
    assert not agent_runs.run_dir("adamw", 1, runs=agent_runs.cli_runs).exists()
    assert_same_agent_run(agent_runs.run_dir("agent", 1), agent_runs.reference, resumes=0)


def test_an_agent_arm_whose_evaluator_dies_during_the_anchor_evaluation_can_be_started_again(crash):
    run_dir = crash.run_dir("agent", 1)
    result = child(crash, resume=False, env={"KILL_EVALUATE_AT": "2"})
    assert result.returncode == 1 and "the evaluator of" in result.stderr, result.stderr[-2000:]
    assert not (run_dir / "start.json").exists() and not (run_dir / "training" / "resume.pt").exists()

    code, _, err = call_cli(*crash.run_args("agent", 1))
    assert code == 0, err
    assert_same_agent_run(run_dir, crash.reference, resumes=0)


def test_an_agent_arm_killed_while_writing_its_first_resume_checkpoint_ends_like_an_uninterrupted_run(
        crash):
    torn = '''
import os, signal, sys, tempfile
from pathlib import Path
import opalctl.checkpoints, opalctl.files
original = opalctl.files.atomic_write_bytes
def torn(path, data, *args, **kwargs):
    path = Path(path)
    if path.name == "resume.pt":
        fd, temporary = tempfile.mkstemp(prefix=".resume.pt.", suffix=".tmp", dir=path.parent)
        os.write(fd, data[: len(data) // 2])
        os.fsync(fd)
        os.kill(os.getpid(), signal.SIGKILL)
    return original(path, data, *args, **kwargs)
opalctl.files.atomic_write_bytes = torn
opalctl.checkpoints.atomic_write_bytes = torn
from opalctl.cli import main
main(sys.argv[1:])
'''
    run_dir = crash.run_dir("agent", 1)
    result = crash.process(crash.run_args("agent", 1), python=["-c", torn])
    assert result.returncode == KILLED, result.stderr[-2000:]
    assert (run_dir / "start.json").exists() and not (run_dir / "training" / "resume.pt").exists()
    finish(crash, run_dir)
    assert [e["kind"] for e in events(run_dir)].count("start") == 1
    assert_same_agent_run(run_dir, crash.reference, resumes=0)


# -- 4. the agent's waiting is outside the budget clock ----------------------------------------------------------

class FakeClock(Clock):
    """Charges scripted amounts, one per update; ``open`` says whether a timed interval is running."""

    name = "fake"

    def __init__(self, charges, watch=None):
        self.charges = list(charges)
        self.given = []
        self.open = False
        self.watch = watch
        self.changed = []

    def _files(self):
        if self.watch is None or not self.watch.exists():
            return {}
        return {str(p.relative_to(self.watch)): p.stat().st_size for p in self.watch.rglob("*") if p.is_file()}

    def start(self):
        assert not self.open, "start() called twice without stop()"
        self.open = True
        return self._files()

    def stop(self, token):
        assert self.open, "stop() without start()"
        self.open = False
        after = self._files()
        if after != token:
            self.changed.append(sorted(name for name in set(after) | set(token) if after.get(name) != token.get(name)))
        charge = self.charges.pop(0)
        self.given.append(charge)
        return charge


CHARGES = [1 / 256] * 256  # dyadic: the sums are exact, the budget of 1.0 is spent at update 256
SLEEP = 0.1


def fake_clock_runs(project, monkeypatch, watch=None):
    """The plain and the agent arm on a cpu budget of 1.0 under the same scripted charges; the agent sleeps
    ``SLEEP`` seconds per decision and notes whether a timed interval was open meanwhile."""
    from opalctl.opal.decisions import HostedLine

    freeze_agent_protocol(project, budget={"clock": "cpu", "amount": 1.0})
    clocks: dict[str, FakeClock] = {}
    decided: list[bool] = []
    call = HostedLine.call  # the heuristic answers in the agent host; the training process waits for it here

    def slow_call(self, number, message, facts, files):
        decided.append(clocks["agent"].open)
        time.sleep(SLEEP)
        return call(self, number, message, facts, files)

    monkeypatch.setattr(HostedLine, "call", slow_call)
    # what the agent's programs cost outside the updates (building a version, its state at a checkpoint) is charged
    # by the cpu clock, at the CPU seconds they took (tests/driver/test_agent_code_charge.py); here it is left out,
    # so that the scripted charges are the whole budget and the waiting alone is what is shown not to be charged
    from opalctl.driver.budget import CpuClock

    monkeypatch.setattr(CpuClock, "agent_code_charge", classmethod(lambda cls, cpu_seconds, wall_seconds: 0.0))
    reports = {}
    for arm in ("adamw", "agent"):
        def factory(name, arm=arm):
            assert name == "cpu"
            clocks[arm] = FakeClock(CHARGES + [0.5] * 5,
                                    watch=(project.run_dir(arm, 1) / watch) if watch is not None else None)
            return clocks[arm]

        reports[arm] = project.run(arm, 1, clock_factory=factory)
    return reports, clocks, decided


@pytest.fixture(scope="module")
def fake_clock(made_project):
    """``fake_clock_runs`` once for the module, watching the agent's records folder (the watch only reads)."""
    project = made_project("agent-arm-clock")
    with pytest.MonkeyPatch.context() as monkeypatch:
        reports, clocks, decided = fake_clock_runs(project, monkeypatch, watch="opal")
    return project, reports, clocks, decided


def test_the_agents_waiting_is_not_charged_to_the_budget(fake_clock):
    project, reports, clocks, decided = fake_clock
    plain, agent = reports["adamw"], reports["agent"]
    run_dir = project.run_dir("agent", 1)

    # the agent decided, slowly, and never while an update was being timed
    assert agent["agent"]["decisions_asked"] == 8 and agent["agent"]["decisions_applied"] >= 1
    assert decided == [False] * 8
    assert agent["agent"]["waiting_seconds"] >= 8 * SLEEP
    assert agent["seconds"]["agent_wait_wall"] >= 8 * SLEEP and plain["seconds"]["agent_wait_wall"] == 0.0

    # the charges are exactly the scripted ones, one per update, for both arms alike
    assert clocks["agent"].given == clocks["adamw"].given == CHARGES
    assert agent["updates"] == plain["updates"] == 256
    assert agent["budget"]["used"] == plain["budget"]["used"] == 1.0 and agent["budget"]["overshoot"] == 0.0
    assert [s["update"] for s in agent["stages"]] == [s["update"] for s in plain["stages"]] == [64, 128, 192, 256]
    assert [s["budget_used"] for s in agent["stages"]] == [s["budget_used"] for s in plain["stages"]]
    assert [s["charge"] for s in read_steps(run_dir / "training" / "steps.jsonl.gz")] == CHARGES
    # decisions fall due by the fraction of the budget charged so far: the first update that reaches each one
    log = events(run_dir)
    fractions = log[0]["schedule"]
    due = []
    for fraction in fractions:
        update = next(n for n in range(1, 257) if n / 256 >= fraction)
        if update not in due:
            due.append(update)
    assert [e["update"] for e in log if e["kind"] == "requested"] == due

    # the training seconds leave the waiting out: they are the timed updates' seconds and nothing else, and neither
    # timed update beside a decision (the one it fell due at, the one after its wait) held its wait of SLEEP (a
    # digits update takes about a millisecond); compared with the rows, not with the plain arm's seconds, and only
    # beside the decisions, where a wait would land, so that a loaded machine's stall elsewhere cannot fail it
    # (once, an update far from any decision took 0.107 s in CI)
    assert agent["seconds"]["train_cpu"] == plain["seconds"]["train_cpu"] == 1.0
    walls = [s["wall"] for s in read_steps(run_dir / "training" / "steps.jsonl.gz")]
    assert agent["seconds"]["train_wall"] == pytest.approx(sum(walls), rel=1e-6)
    beside = {update: walls[update - 1] for at in due for update in (at, at + 1) if update <= len(walls)}
    assert max(beside.values()) < SLEEP, sorted(((w, u) for u, w in beside.items()), reverse=True)[:4]


def test_no_agent_record_is_written_inside_a_timed_update(fake_clock):
    _, _, clocks, _ = fake_clock
    assert clocks["agent"].given == CHARGES
    assert clocks["agent"].changed == []


# -- 5. compare and show -----------------------------------------------------------------------------------------

def test_compare_and_show_report_the_agents_figures_and_decisions(agent_runs):
    agent_project = agent_runs
    reports = {seed: support.read(agent_project.run_dir("agent", seed) / "report.json")["agent"] for seed in (1, 2)}

    code, out, err = call_cli("compare", agent_project.lock, "--runs-dir", agent_project.runs, "--json")
    assert code == 0, err
    rows = {row["arm"]: row for row in json.loads(out)["arms"]}
    assert set(rows) == {"adamw", "agent"} and rows["agent"]["seeds"] == [1, 2]
    assert rows["adamw"]["agent"] is None
    figures = rows["agent"]["agent"]
    for key in ("decisions_asked", "decisions_applied", "decisions_reverted", "waiting_seconds", "cost_usd"):
        values = [reports[1][key], reports[2][key]]
        assert figures[key]["n"] == 2, key
        assert figures[key]["mean"] == pytest.approx(sum(values) / 2), key
        assert (figures[key]["min"], figures[key]["max"]) == (pytest.approx(min(values)), pytest.approx(max(values)))
    assert figures["decisions_asked"]["mean"] == 8 and figures["decisions_applied"]["min"] >= 1

    run_dir = agent_project.run_dir("agent", 1)
    log = events(run_dir)
    code, out, err = call_cli("show", run_dir, "--json")
    assert code == 0, err
    shown = json.loads(out)
    decisions = shown["decisions"]
    asked = [e for e in log if e["kind"] == "requested"]
    answers = {e["decision"]: e for e in log if e["kind"] in ("applied", "kept", "load_failed", "decision_failed")}
    assert [d["decision"] for d in decisions] == [e["decision"] for e in asked] == list(range(1, 9))
    for decision, request in zip(decisions, asked):
        answer = answers[request["decision"]]
        assert decision["asked_at"] == request["update"] and decision["reason"] == "scheduled"
        assert decision["outcome"] == answer["kind"] and decision["answered_at"] == answer["update"]
        assert decision["rationale"] == answer["rationale"] and decision["rationale"].startswith("Observed:")
    assert {d["outcome"] for d in decisions} == {"applied", "kept"}
    assert sum(d["outcome"] == "applied" for d in decisions) == reports[1]["decisions_applied"]
    assert shown["report"]["agent"] == reports[1]

    code, out, err = call_cli("show", run_dir)
    assert code == 0, err
    lines = out.splitlines()
    title = lines.index("agent decisions")
    assert lines[title + 1].split()[:3] == ["decision", "asked", "at"]
    rows = lines[title + 2:title + 2 + len(decisions)]
    for row, decision in zip(rows, decisions, strict=True):
        cells = row.split()
        assert cells[:4] == [str(decision["decision"]), str(decision["asked_at"]), "scheduled", decision["outcome"]]
        assert (decision["summary"] or decision["rationale"])[:40] in row

    # a plain arm shows no agent decisions
    code, out, err = call_cli("show", agent_project.run_dir("adamw", 1))
    assert code == 0 and "agent decisions" not in out


# -- 6. an LLM backend that cannot work is refused before any work ----------------------------------------------

@pytest.mark.parametrize("backend,needs", [("anthropic", "ANTHROPIC_API_KEY"), ("claude-code", "OPALCTL_CLAUDE_BIN")])
def test_an_llm_backend_without_its_key_or_binary_is_refused_by_run(project, monkeypatch, backend,
                                                                       needs):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("OPALCTL_CLAUDE_BIN", str(project.folder / "no-such-claude"))
    lock = freeze_agent_protocol(project, arms={"adamw": ADAMW, "llm": {**ADAMW, "agent": {"backend": backend}}})
    assert support.read(lock)  # the protocol freezes: the schema accepts the backend
    code, out, err = call_cli(*project.run_args("llm", 1))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opalctl: error: ") and repr(backend) in lines[0]
    assert needs in lines[0]
    run_dir = project.run_dir("llm", 1)
    assert not (run_dir / "start.json").exists() and not (run_dir / "training" / "opal").exists()
