"""With the starting programs and an agent that changes nothing, a wrapped run is bit for bit the plain
run: ``torch.equal`` on every parameter after 200 updates, whatever the user's optimizer, scheduler and clipping."""

import pytest
import torch

from opalctl.opal import wrap

STEPS = 200


def _optimizers():
    return {
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
        "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
        "sgd_nesterov": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
    }


@pytest.mark.parametrize("kind", sorted(_optimizers()))
def test_keep_backend_is_the_plain_run(opal, run_dir, kind):
    make = _optimizers()[kind]
    plain = opal.make_model()
    opal.train(plain, make(plain.parameters()), STEPS, plain=True)

    model = opal.make_model()
    optimizer = wrap(make(model.parameters()), model, backend="keep", total_steps=STEPS, run_dir=run_dir)
    opal.train(model, optimizer, STEPS)
    figures = optimizer.close()

    assert figures["decisions_asked"] == 8 and figures["decisions_kept"] == 8  # the agent was asked, and kept
    assert optimizer.t == STEPS
    assert opal.mismatches(plain, model) == []
    # and the test can tell: one update fewer is a different point
    shorter = opal.make_model()
    opal.train(shorter, make(shorter.parameters()), STEPS - 1, plain=True)
    assert opal.mismatches(plain, shorter)


def _lambda(step):
    return 1.0 / (1.0 + 0.02 * step)


def test_scheduler_handed_over_is_stepped_once_per_update(opal, run_dir):
    plain = opal.make_model()
    plain_optimizer = opal.adamw(plain)
    plain_scheduler = torch.optim.lr_scheduler.LambdaLR(plain_optimizer, _lambda)
    opal.train(plain, plain_optimizer, STEPS, plain=True, scheduler=plain_scheduler)

    model = opal.make_model()
    base = opal.adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(base, _lambda)
    optimizer = wrap(base, model, backend="keep", total_steps=STEPS, run_dir=run_dir, scheduler=scheduler)
    opal.train(model, optimizer, STEPS)  # the wrapped loop never calls scheduler.step() itself
    optimizer.close()

    assert scheduler.last_epoch == plain_scheduler.last_epoch == STEPS
    assert base.param_groups[0]["lr"] == plain_optimizer.param_groups[0]["lr"]
    assert opal.mismatches(plain, model) == []
    # without the scheduler the run differs, so the comparison above is not vacuous
    assert opal.mismatches(plain, opal.plain_adamw(STEPS))


def test_clip_handed_over_clips_before_the_step(opal, run_dir):
    plain = opal.plain_adamw(STEPS, clip=1.0)

    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="keep", total_steps=STEPS, run_dir=run_dir, clip=1.0)
    opal.train(model, optimizer, STEPS)
    optimizer.close()

    assert opal.mismatches(plain, model) == []
    assert opal.mismatches(plain, opal.plain_adamw(STEPS))  # clipping does change this run


def test_step_with_a_closure(opal, run_dir):
    def closure_for(model, optimizer, update):
        def closure():
            optimizer.zero_grad()
            loss = opal.loss_at(model, update)
            loss.backward()
            return loss

        return closure

    plain = opal.make_model()
    plain_optimizer = opal.adamw(plain)
    plain_losses = [float(plain_optimizer.step(closure_for(plain, plain_optimizer, u)).detach()) for u in range(STEPS)]

    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="keep", total_steps=STEPS, run_dir=run_dir)
    losses = [float(optimizer.step(closure=closure_for(model, optimizer, u)).detach()) for u in range(STEPS)]
    optimizer.close()

    assert losses == plain_losses  # step returns the closure's loss
    assert opal.mismatches(plain, model) == []
    # the closure's losses were recorded: every update of the run is in losses.jsonl
    import json

    bins = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert sum(b["count"] for b in bins) == STEPS
    assert bins[0]["mean"] == pytest.approx(sum(plain_losses[:25]) / 25)


def test_heuristic_is_the_plain_run_until_it_applies_a_change(opal, run_dir):
    """Snapshots after every update: equal to the plain run's up to the update the first change applies at."""
    plain = opal.make_model()
    plain_optimizer = opal.adamw(plain)
    expected = []
    for update in range(STEPS):
        opal.train(plain, plain_optimizer, 1, start=update, plain=True)
        expected.append([p.detach().clone() for p in plain.parameters()])

    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", total_steps=STEPS, run_dir=run_dir)
    seen = []
    for update in range(STEPS):
        opal.train(model, optimizer, 1, start=update)
        seen.append([p.detach().clone() for p in model.parameters()])
    optimizer.close()

    log = opal.events(run_dir)
    applied = opal.of_kind(log, "applied")
    first_change = applied[0]["update"] if applied else STEPS
    kept_before = [e for e in opal.of_kind(log, "kept") if e["update"] <= first_change]
    assert len(kept_before) >= 3, "the heuristic should keep at its early decisions on this run"
    # seen[i] is the state after update i (i + 1 updates); a change applied at update U first steps update U
    for update in range(first_change):
        assert all(torch.equal(a, b) for a, b in zip(expected[update], seen[update])), f"differs after update {update}"
    if applied:
        assert not all(torch.equal(a, b) for a, b in zip(expected[-1], seen[-1]))


def test_heuristic_that_never_changes_anything_is_the_plain_run(opal, run_dir):
    """Early in a long budget (20 % of it) no rule of the heuristic fires on this run: equal at the end."""
    plain = opal.plain_adamw(STEPS)
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="heuristic", total_steps=5 * STEPS, run_dir=run_dir,
                     decisions=4, schedule=[0.05, 0.1, 0.15, 0.19])
    opal.train(model, optimizer, STEPS)
    figures = optimizer.close()
    assert figures["decisions_asked"] == 4
    assert figures["decisions_applied"] == 0
    assert opal.mismatches(plain, model) == []
