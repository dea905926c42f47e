"""A failing program never ends training. Each test hands the optimizer one bad ``updater.py`` through a
callable backend at a known update, runs every update, finds the right event in ``events.jsonl``, and checks that
the parameters are exactly where the fallback program's path leads.

The semantics tested (``AgentOptimizer.step``, ``Recovery.step_failed``, the slots' trial snapshot): during a new version's trial a
snapshot (parameters, gradients, the base torch optimizer's state; for the first step the base state from just
before the swap) is taken before each step; a failure restores it and the same update is redone by the last
version that passed its trial. The base optimizer's state (AdamW's moments and step count) persists across
versions, so after a failure AdamW continues from the state it had when the new program took over.
"""

import pytest
import torch

from opalctl.opal import wrap

STEPS = 80
AT = 0.125  # the decision falls before update 10


def run_with(opal, run_dir, updater=None, *, steps=STEPS, analysis=None, scheduler_lambda=None, **options):
    model = opal.make_model()
    base = opal.adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(base, scheduler_lambda) if scheduler_lambda else None
    writer = opal.Writer(updater=updater, analysis=analysis)
    optimizer = wrap(base, model, backend=writer, decisions=1, schedule=[AT], total_steps=steps, run_dir=run_dir,
                     scheduler=scheduler, **options)
    opal.train(model, optimizer, steps)
    figures = optimizer.close()
    log = opal.events(run_dir)
    assert optimizer.t == steps, "the run must finish all its updates"
    assert log[-1]["kind"] == "end" and log[-1]["update"] == steps
    assert len(writer.calls) == 1
    return model, optimizer, figures, log


def applied_at(opal, log):
    applied = opal.of_kind(log, "applied")
    assert len(applied) == 1, log
    return applied[0]["update"]


def only(opal, log, kind):
    found = opal.of_kind(log, kind)
    assert len(found) == 1, [e["kind"] for e in log]
    return found[0]


# -- refused at load: load_failed, version 0 goes on, exactly the plain run -----------------------------------------

LOAD_FAILURES = {
    "syntax_error": ("def build(params, previous, spec):\n    return (\n", "syntax error"),
    "opens_a_file": (None, "open"),
    "imports_subprocess": ("import subprocess\n", "subprocess"),
    "build_raises": ("def build(params, previous, spec):\n    raise ValueError('no')\n", "build() raised ValueError"),
    "no_build": ("import torch\nX = 1\n", "must define build"),
}


@pytest.mark.parametrize("case", sorted(LOAD_FAILURES))
def test_a_program_that_cannot_load_leaves_version_0_running(opal, run_dir, case):
    source, words = LOAD_FAILURES[case]
    if case == "opens_a_file":
        source = opal.sgd_updater(body="        open('/tmp/opal-test-should-not-exist', 'w')")
    elif case == "imports_subprocess":
        source = source + opal.sgd_updater()
    model, optimizer, figures, log = run_with(opal, run_dir, source)

    failed = only(opal, log, "load_failed")
    assert failed["version"] == 1 and failed["update"] == 10
    assert words in failed["message"], failed["message"]
    assert not opal.of_kind(log, "applied", "reverted")
    assert optimizer.current.number == 0 and figures["version"] == 0 and figures["decisions_load_failed"] == 1
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []
    # the refused program is kept in the records, and the agent is told at its next decision
    assert (run_dir / "programs" / "v001" / "updater.py").read_text() == source
    assert any(e["kind"] == "load_failed" for e in optimizer.observer.errors)


# -- fails at its first step: the state from just before the swap comes back exactly, the update is redone --------

def test_raises_at_its_first_step(opal, run_dir):
    # build() also changes the user's optimizer (a learning rate, a moment): that must be undone as well
    build_body = ("    spec.optimizer.param_groups[0]['lr'] = 1.0\n"
                  "    for state in spec.optimizer_state_by_name().values():\n"
                  "        state['exp_avg'].zero_()")
    model, optimizer, figures, log = run_with(opal, run_dir, opal.sgd_updater(fail_at=1, build_body=build_body))

    at = applied_at(opal, log)
    reverted = only(opal, log, "reverted")
    assert (reverted["update"], reverted["version"], reverted["to"]) == (at, 1, 0)
    assert reverted["reason"] == "exception" and "deliberate failure at step 1" in reverted["message"]
    assert reverted["restored"] == "exact"
    assert "RuntimeError" in reverted["traceback"]
    assert optimizer.current.number == 0 and figures["decisions_reverted"] == 1
    assert optimizer.base.param_groups[0]["lr"] == 1e-2
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []


def test_writes_nan_at_its_first_step(opal, run_dir):
    source = opal.broken_updater("        for p in self.params.values():\n"
                                 "            p.fill_(float('nan'))")
    model, optimizer, figures, log = run_with(opal, run_dir, source)

    reverted = only(opal, log, "reverted")
    assert reverted["update"] == applied_at(opal, log)
    assert reverted["reason"] == "check" and "non-finite" in reverted["message"]
    assert reverted["restored"] == "exact"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []


def test_changes_a_parameters_dtype(opal, run_dir):
    source = opal.broken_updater("        for p in self.params.values():\n"
                                 "            p.data = p.data.double()")
    model, optimizer, figures, log = run_with(opal, run_dir, source)

    reverted = only(opal, log, "reverted")
    assert reverted["update"] == applied_at(opal, log)
    assert reverted["reason"] == "check" and "dtype" in reverted["message"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []


def test_loops_forever(opal, run_dir):
    import time

    started = time.perf_counter()
    source = opal.broken_updater("        while True:\n            pass")
    model, optimizer, figures, log = run_with(opal, run_dir, source, step_time_limit=0.5)

    assert time.perf_counter() - started < 10
    reverted = only(opal, log, "reverted")
    assert reverted["update"] == applied_at(opal, log)
    assert reverted["reason"] == "timeout" and reverted["restored"] == "exact"
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []


def test_raises_systemexit(opal, run_dir):
    source = opal.broken_updater("        raise SystemExit(3)")
    model, optimizer, figures, log = run_with(opal, run_dir, source)
    assert only(opal, log, "reverted")["restored"] == "exact"
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []


# -- fails later: the path is the new program's steps, then the fallback ---------------------------------------------

def expected_path(opal, at, sgd_steps, steps=STEPS):
    """AdamW for ``at`` updates, ``sgd_steps`` plain SGD steps by hand, then AdamW again from the state it had at
    the swap (SGD never touched it)."""
    model = opal.make_model()
    base = opal.adamw(model)
    opal.train(model, base, at, plain=True)
    opal.manual_sgd(model, sgd_steps, start=at)
    opal.train(model, base, steps - at - sgd_steps, start=at + sgd_steps, plain=True)
    return model


def test_raises_at_its_tenth_step_during_the_trial(opal, run_dir):
    # the tenth step updates the parameters, then raises: the snapshot from before that step comes back
    model, optimizer, figures, log = run_with(opal, run_dir, opal.sgd_updater(fail_at=10))

    at = applied_at(opal, log)
    reverted = only(opal, log, "reverted")
    assert reverted["update"] == at + 9 and reverted["to"] == 0
    assert reverted["restored"] == "exact" and reverted["reason"] == "exception"
    assert not opal.of_kind(log, "trial_passed")
    assert optimizer.current.number == 0
    assert optimizer.slots.versions[1].status == "failed"
    expected = expected_path(opal, at, 9)
    assert opal.mismatches(expected, model) == []
    # not vacuous: the run differs from the plain run and from a path with one SGD step more or less
    assert opal.mismatches(opal.plain_adamw(STEPS), model)
    assert opal.mismatches(expected_path(opal, at, 10), model)
    assert opal.mismatches(expected_path(opal, at, 8), model)


def test_raises_after_its_trial_passed(opal, run_dir):
    model, optimizer, figures, log = run_with(opal, run_dir, opal.sgd_updater(fail_at=10, touch_first=False),
                                              trial_steps=5)

    at = applied_at(opal, log)
    assert only(opal, log, "trial_passed")["update"] == at + 5
    reverted = only(opal, log, "reverted")
    assert reverted["update"] == at + 9 and reverted["to"] == 0  # it was its own fallback: version 0 takes over
    assert optimizer.current.number == 0
    assert opal.mismatches(expected_path(opal, at, 9), model) == []


# -- the fallback must undo everything a failing first step (or its build) did ---------------------------------------

def test_build_that_moves_the_parameters_then_fails_is_undone(opal, run_dir):
    build_body = ("    with torch.no_grad():\n"
                  "        for p in params.values():\n"
                  "            p.mul_(0.5)")
    model, optimizer, figures, log = run_with(opal, run_dir, opal.sgd_updater(fail_at=1, build_body=build_body))
    assert only(opal, log, "reverted")["restored"] == "exact"
    assert opal.mismatches(opal.plain_adamw(STEPS), model) == []


def _decay(step):
    return 1.0 / (1.0 + 0.05 * step)


def test_a_failing_first_step_that_stepped_the_scheduler_is_undone(opal, run_dir):
    source = opal.broken_updater("        self.spec.optimizer.step()\n"
                                 "        self.spec.scheduler.step()\n"
                                 "        raise RuntimeError('after the scheduler')")
    model, optimizer, figures, log = run_with(opal, run_dir, source, scheduler_lambda=_decay)
    assert only(opal, log, "reverted")["restored"] == "exact"
    plain = opal.make_model()
    plain_optimizer = opal.adamw(plain)
    scheduler = torch.optim.lr_scheduler.LambdaLR(plain_optimizer, _decay)
    opal.train(plain, plain_optimizer, STEPS, plain=True, scheduler=scheduler)
    assert optimizer.spec.scheduler.last_epoch == STEPS
    assert opal.mismatches(plain, model) == []


def test_a_program_that_goes_bad_after_its_trial_rolls_back_to_the_last_kept_state(opal, run_dir):
    # Applied at update 20 (AT of 160), it writes NaN at its 60th step (update 80), after its trial passed. The
    # periodic check (every 25 updates, with the analysis) finds it at 100; the state to roll back to is renewed on
    # every GOOD_EVERY-th check only, so it is the one kept at 25 (the program's first check), not 50 or 75.
    # Version 0 goes on from there.
    from opalctl.opal.optimizer import GOOD_EVERY

    assert GOOD_EVERY == 4
    body = ("        if self.count == 60:\n"
            "            next(iter(self.params.values())).fill_(float('nan'))")
    steps = 160
    model, optimizer, figures, log = run_with(opal, run_dir, opal.sgd_updater(body=body), steps=steps,
                                              trial_steps=5, max_wakes=0)  # (the NaN losses would wake the agent)
    at = applied_at(opal, log)
    assert at == 20
    reverted = only(opal, log, "reverted")
    assert reverted["update"] == 100 and reverted["reason"] == "check" and reverted["to"] == 0
    assert reverted["restored"] == "rolled back to update 25"
    assert optimizer.current.number == 0
    expected = opal.make_model()
    base = opal.adamw(expected)
    opal.train(expected, base, at, plain=True)
    opal.manual_sgd(expected, 25 - at, start=at)
    opal.train(expected, base, steps - 100, start=100, plain=True)
    assert opal.mismatches(expected, model) == []
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
