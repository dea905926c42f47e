"""The agent optimizer's parts, each on its own or through the optimizer: the one place agent code runs
contained, the records' event kinds and held lines, the losses line and its plain twin, the snapshots, the
figures, and what the decisions keep of the answers they timed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from opalctl.formats import AgentFigures, Event
from opalctl.opal import wrap
from opalctl.opal.guard import StepFailure, StepGuard, StepTimeout, contained
from opalctl.opal.observer import losses_line, losses_line_plain
from opalctl.opal.records import OpalRecords
from opalctl.opal.slots import Snapshot

STEPS = 60


# -- agent code, contained -----------------------------------------------------------------------------------------
def test_agent_code_that_fails_hands_back_its_error_even_a_keyboard_interrupt_it_raised_itself():
    assert contained(lambda x: x + 1, 1) == (2, None)
    for error in (RuntimeError("boom"), StepTimeout("late"), SystemExit(3), StepFailure("bad"), KeyboardInterrupt(),
                  GeneratorExit()):
        def fail(error=error):
            raise error

        value, caught = contained(fail)
        assert value is None and caught is error


def test_a_step_over_its_limit_is_a_failure_even_without_the_alarm():
    guard = StepGuard(0.01, {})
    guard.active = False  # as off the main thread
    elapsed = guard.run(None, lambda: None)
    guard.enforce(elapsed)  # in time: nothing
    with pytest.raises(StepFailure, match="over its limit"):
        guard.enforce(0.5)


# -- records -------------------------------------------------------------------------------------------------------
def test_records_refuse_an_event_kind_that_is_not_an_event(tmp_path):
    records = OpalRecords(tmp_path)
    with pytest.raises(ValueError, match="rejected"):
        records.event("rejected", update=0)
    for kind in sorted(Event.ALL):
        records.event(kind, update=0)
    records.close()
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kinds == sorted(Event.ALL)


def test_lines_written_inside_a_hold_wait_for_the_flush_in_order(tmp_path):
    records = OpalRecords(tmp_path)
    records.event(Event.START, update=0)
    with records.hold:
        records.event(Event.LOG, update=1)
        records.write_line("losses", '{"update":1}\n')
        assert records.waiting
        assert len((tmp_path / "events.jsonl").read_text().splitlines()) == 1
    records.event(Event.LOG, update=2)  # outside the hold: the held lines go first
    assert not records.waiting
    updates = [json.loads(line)["update"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert updates == [0, 1, 2] and (tmp_path / "losses.jsonl").read_text() == '{"update":1}\n'
    records.close()


# -- the losses line -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_bin", [
    {"start": 1, "end": 25, "count": 25, "mean": 0.1 + 0.2, "min": 1e-300, "max": 12345.678, "nonfinite": 0},
    {"start": 26, "end": 50, "count": 25, "mean": None, "min": None, "max": None, "nonfinite": 25},
    {"start": 51, "end": 51, "count": 1, "mean": -0.0, "min": -0.0, "max": -0.0, "nonfinite": 0},
    {"start": 3, "end": 7, "count": 5, "mean": 1 / 3, "min": math.pi, "max": 2.0 ** 70, "nonfinite": 1},
], ids=["ordinary", "all-non-finite", "negative-zero", "long-floats"])
def test_the_hand_formatted_losses_line_is_the_json_line(loss_bin):
    line = losses_line(loss_bin, loss_bin["end"])
    assert line == losses_line_plain(loss_bin, loss_bin["end"])
    assert json.loads(line) == {**loss_bin, "update": loss_bin["end"]}


def test_the_losses_file_of_a_run_is_the_plain_twins_lines(opal, run_dir):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="keep", total_steps=STEPS, every=10, run_dir=run_dir)
    opal.train(model, optimizer, STEPS, losses={13: float("nan")})
    optimizer.close()
    for line in (run_dir / "losses.jsonl").read_text().splitlines(keepends=True):
        value = json.loads(line)
        assert line == losses_line_plain({k: v for k, v in value.items() if k != "update"}, value["update"])


# -- snapshots -----------------------------------------------------------------------------------------------------
def test_a_snapshot_restores_the_parameters_gradients_optimizer_and_scheduler_it_took(opal):
    model = opal.make_model()
    base = opal.adamw(model)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=3, gamma=0.5)
    opal.train(model, base, 4, plain=True, scheduler=scheduler)
    from opalctl.opal.program_view import Spec

    named = dict(model.named_parameters())
    spec = Spec(base, scheduler, None, STEPS, None, named)
    snapshot = Snapshot.take(4, named, spec)
    kept = ({k: p.detach().clone() for k, p in named.items()}, {k: p.grad.clone() for k, p in named.items()},
            json.dumps(base.state_dict()["param_groups"]), scheduler.state_dict())
    opal.train(model, base, 3, start=4, plain=True, scheduler=scheduler)
    snapshot.restore(named, spec)
    assert all(torch.equal(p, kept[0][k]) and torch.equal(p.grad, kept[1][k]) for k, p in named.items())
    assert json.dumps(base.state_dict()["param_groups"]) == kept[2] and scheduler.state_dict() == kept[3]
    # and training on from the restored state is training on from the state it took
    opal.train(model, base, 3, start=4, plain=True, scheduler=scheduler)
    reference = opal.make_model()
    reference_base = opal.adamw(reference)
    opal.train(reference, reference_base, 7, plain=True,
               scheduler=torch.optim.lr_scheduler.StepLR(reference_base, step_size=3, gamma=0.5))
    assert not opal.mismatches(model, reference)


COUNTING_UPDATER_FIND = "        self.count = 0\n"
COUNTING_UPDATER_REPLACE = "        self.count = 0\n        self.state_dict_calls = 0\n"
COUNTING_STATE_FIND = "    def state_dict(self):\n"
COUNTING_STATE_REPLACE = "    def state_dict(self):\n        self.state_dict_calls += 1\n"


@pytest.mark.parametrize("fail_at", [3, 0], ids=["trial-fails", "passes-then-rolls-back"])
def test_no_snapshot_copies_a_programs_own_state(opal, run_dir, fail_at):
    """The version running when a snapshot is taken never reads that state back (it failed, or build() only read
    it): the trial's and the rollback's snapshots leave ``updater.state_dict()`` alone."""
    source = opal.sgd_updater(fail_at=fail_at).replace(COUNTING_UPDATER_FIND, COUNTING_UPDATER_REPLACE)
    source = source.replace(COUNTING_STATE_FIND, COUNTING_STATE_REPLACE)
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=source), decisions=1, schedule=[0.1],
                     total_steps=STEPS, every=5, trial_steps=4, run_dir=run_dir)
    opal.train(model, optimizer, STEPS - 20)
    version = optimizer.slots.versions[1]
    if not fail_at:  # a non-finite parameter after the trial: the periodic check rolls back to the last good state
        with torch.no_grad():
            next(model.parameters()).fill_(float("nan"))
    opal.train(model, optimizer, 20, start=STEPS - 20)
    optimizer.close()
    reverted = opal.of_kind(run_dir, "reverted")
    assert [e["version"] for e in reverted] == [1]
    assert reverted[0]["restored"].startswith("exact" if fail_at else "rolled back to update")
    assert version.updater.state_dict_calls == 0
    assert version.status == "failed" and optimizer.current.number == 0


# -- figures -------------------------------------------------------------------------------------------------------
def test_the_figures_are_the_agent_figures_and_count_failed_steps(opal, run_dir):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=opal.sgd_updater(fail_at=3)),
                     decisions=1, schedule=[0.1], total_steps=STEPS, run_dir=run_dir)
    opal.train(model, optimizer, STEPS)
    figures = optimizer.close()
    assert figures == AgentFigures.from_json(figures).to_json()
    assert figures["step_failures"] == 1 and figures["decisions_reverted"] == 1
    end = opal.of_kind(run_dir, "end")[0]
    assert end["step_failures"] == 1


# -- what the decisions keep ---------------------------------------------------------------------------------------
def test_an_answer_that_did_not_load_counts_in_the_expected_lag(opal, run_dir):
    """With ``blocking="auto"`` a decision after the first waits when answers are expected to take more than
    ``max_lag`` updates. A quick answer whose program did not load is an answer: the second decision then runs in
    the background (before, only applied and kept answers were timed, and 27 s were assumed)."""
    model = opal.make_model()
    broken = "def build(params, previous, spec):\n    return None\n"  # no step(): load_failed
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=broken, always=True), decisions=2,
                     schedule=[0.2, 0.6], blocking="auto", max_lag=1000, total_steps=100, run_dir=run_dir)
    # each update sleeps a little, so that the answer, read in a thread, comes during the 40 updates left after
    # the second request even on a loaded machine (else it arrives after the last update: late, never loaded)
    opal.train(model, optimizer, 100, sleep=0.01)
    optimizer.close()
    requested = opal.of_kind(run_dir, "requested")
    answered = opal.of_kind(run_dir, "load_failed")
    assert len(requested) == len(answered) == 2
    assert answered[0]["update"] == requested[0]["update"]  # the first decision waits
    assert answered[1]["update"] > requested[1]["update"]  # the second ran while training went on
