"""``state_dict()`` / ``load_state_dict()`` resume a run exactly, and the records under the run folder
(events, programs, decisions) are complete and never hold a secret."""

import json

import pytest
import torch

from opalctl.formats import RecordDamaged
from opalctl.opal import wrap

STEPS = 200

MOMENTUM_UPDATER = '''"""Heavy-ball momentum with its own state (kept by the updater, not by the torch optimizer)."""

import torch

BETA = 0.9
LR = 0.01


def build(params, previous, spec):
    return Updater(params)


class Updater:
    def __init__(self, params):
        self.params = params
        self.buf = {}

    def step(self, grads, update, ctx):
        for name, p in self.params.items():
            g = grads[name]
            if g is None:
                continue
            b = self.buf.get(name)
            if b is None:
                b = torch.zeros_like(p)
                self.buf[name] = b
            b.mul_(BETA).add_(g)
            p.sub_(b * LR)

    def state_dict(self):
        return {"buf": {name: b.clone() for name, b in self.buf.items()}}

    def load_state_dict(self, state):
        self.buf = {name: b.clone() for name, b in state["buf"].items()}
'''


def _backend(opal, kind):
    if kind == "heuristic":
        return "heuristic"
    return opal.Writer(updater=MOMENTUM_UPDATER, always=True)  # the same answer whichever decision it is


def _options(kind):
    schedule = [0.05, 0.5] if kind == "callable" else "front"
    return {"decisions": 2 if kind == "callable" else 8, "schedule": schedule, "total_steps": STEPS}


def _uninterrupted(opal, run_dir, kind):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=_backend(opal, kind), run_dir=run_dir, **_options(kind))
    opal.train(model, optimizer, STEPS)
    optimizer.close()
    return model, optimizer


def _resumed(opal, run_dir, kind, cut, checkpoint):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=_backend(opal, kind), run_dir=run_dir, **_options(kind))
    opal.train(model, optimizer, cut)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    opal.train(model, optimizer, 7, start=cut)  # work after the checkpoint that a crash loses
    version_at_cut = optimizer.state_dict()["current"]
    del model, optimizer

    loaded = torch.load(checkpoint, weights_only=True)
    model = opal.make_model(seed=99)  # a fresh process: other initial weights, a fresh torch optimizer
    model.load_state_dict(loaded["model"])
    optimizer = wrap(opal.adamw(model), model, backend=_backend(opal, kind), run_dir=run_dir, **_options(kind))
    optimizer.load_state_dict(loaded["optimizer"])
    assert optimizer.t == cut
    opal.train(model, optimizer, STEPS - cut, start=cut)
    optimizer.close()
    return model, optimizer, version_at_cut


@pytest.mark.parametrize("kind,after", [("callable", 15), ("callable", 35), ("heuristic", 7)])
def test_resume_from_state_dict_continues_exactly(opal, tmp_path, kind, after):
    reference, reference_optimizer = _uninterrupted(opal, tmp_path / "a", kind)
    reference_events = opal.events(tmp_path / "a")
    applied = opal.of_kind(reference_events, "applied")
    assert applied, "a version must be applied before the checkpoint for this test to mean anything"
    cut = applied[0]["update"] + after  # callable: 15 is inside the new version's 20-update trial, 35 after it

    model, optimizer, version_at_cut = _resumed(opal, tmp_path / "b", kind, cut, tmp_path / "checkpoint.pt")

    assert version_at_cut >= 1
    assert opal.mismatches(reference, model) == []
    assert optimizer.current.number == reference_optimizer.current.number
    assert optimizer.slots.fallback.number == reference_optimizer.slots.fallback.number
    assert opal.without_timing([optimizer.figures()]) == opal.without_timing([reference_optimizer.figures()])
    # the records were cut back to the checkpoint and redone: the same events, plus one 'resumed'
    resumed_events = opal.events(tmp_path / "b")
    assert [e["update"] for e in resumed_events if e["kind"] == "resumed"] == [cut]
    assert opal.without_timing([e for e in resumed_events if e["kind"] != "resumed"]) == \
        opal.without_timing(reference_events)
    assert (tmp_path / "b" / "losses.jsonl").read_text() == (tmp_path / "a" / "losses.jsonl").read_text()
    # and the run really depends on the optimizer's state: a resume without it ends elsewhere
    if kind == "callable":
        assert opal.mismatches(opal.plain_adamw(STEPS), model)


def test_state_survives_weights_only_load(opal, run_dir, tmp_path):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=MOMENTUM_UPDATER), decisions=1,
                     schedule=[0.05], total_steps=STEPS, run_dir=run_dir)
    opal.train(model, optimizer, 40)
    state = optimizer.state_dict()
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert loaded["format"] == "opal-state/2" and loaded["current"] == 1 and loaded["t"] == 40
    assert set(loaded["updater"]["buf"]) == {name for name, _ in model.named_parameters()}
    assert all(torch.equal(loaded["updater"]["buf"][k], v) for k, v in state["updater"]["buf"].items())
    assert [v["number"] for v in loaded["versions"]] == [0, 1]
    optimizer.close()


def test_load_state_dict_refuses_a_foreign_state(opal, run_dir):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend="keep", total_steps=STEPS, run_dir=run_dir)
    with pytest.raises(RecordDamaged, match="opal-state/2"):
        optimizer.load_state_dict(opal.adamw(model).state_dict())
    optimizer.close()


# -- records --------------------------------------------------------------------------------------------------------

SECRET = "hunter2-correct-horse-battery-staple"
KEY_SHAPED = "sk-ant-api03-ABCDEFGHIJKLMNOPQRSTUVWX"


def test_records_of_an_applied_change(opal, run_dir):
    model = opal.make_model()
    writer = opal.Writer(updater=opal.sgd_updater())
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=2, schedule=[0.05, 0.5], total_steps=100,
                     run_dir=run_dir)
    opal.train(model, optimizer, 100)
    optimizer.close()

    lines = (run_dir / "events.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) and isinstance(e["kind"], str) for e in parsed)
    kinds = [e["kind"] for e in parsed]
    assert kinds[0] == "start" and kinds[-1] == "end"
    for kind in ("requested", "applied", "trial_passed", "kept"):
        assert kind in kinds
    for version in ("v000", "v001"):
        for name in ("updater.py", "analysis.py"):
            assert (run_dir / "programs" / version / name).is_file()
    assert (run_dir / "programs" / "v000" / "updater.py").read_text() == opal.default_sources()["updater.py"]
    assert (run_dir / "programs" / "v001" / "updater.py").read_text() == opal.sgd_updater()
    assert not (run_dir / "programs" / "v002").exists()  # the second decision kept
    for number, response in (("001", opal.RATIONALE), ("002", None)):
        folder = run_dir / "decisions" / number
        message = (folder / "message.md").read_text()
        assert f"# Decision {int(number)} (scheduled)" in message and "## updater.py (now running)" in message
        if response:
            assert (folder / "response.md").read_text() == response
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["outcome"] == ("applied" if number == "001" else "kept")
    assert (run_dir / "decisions" / "001" / "message.md").read_text() == writer.calls[0]
    losses = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
    assert [b["update"] for b in losses] == [25, 50, 75, 100] and sum(b["count"] for b in losses) == 100
    assert len((run_dir / "reports.jsonl").read_text().splitlines()) == 4


def test_secrets_never_reach_a_file(opal, run_dir):
    rationale = (f"Observed: the key {SECRET} and {KEY_SHAPED} were in the environment.\n"
                 f"Changed: updater.py (token={SECRET}).\nPrediction: none.\nRules: none.")
    model = opal.make_model()
    writer = opal.Writer(updater=opal.sgd_updater(), rationale=rationale)
    optimizer = wrap(opal.adamw(model), model, backend=writer, decisions=1, schedule=[0.05], total_steps=60,
                     run_dir=run_dir, secrets=[SECRET])
    opal.train(model, optimizer, 60)
    optimizer.close()

    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert run_dir / "decisions" / "001" / "response.md" in files
    for path in files:
        data = path.read_bytes()
        assert SECRET.encode() not in data, path
        assert KEY_SHAPED.encode() not in data, path
    response = (run_dir / "decisions" / "001" / "response.md").read_text()
    assert "[redacted]" in response and response.startswith("Observed: the key [redacted]")
    assert "[redacted]" in opal.of_kind(run_dir, "applied")[0]["rationale"]
