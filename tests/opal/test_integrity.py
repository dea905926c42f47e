"""Evaluation integrity: the sample, the ring (sampled correctly whatever the memory layout, without a host
synchronisation), and the rules: a round trip around an evaluation is flagged, a lasting move is information only,
and what ordinary training does (a sustained learning-rate change, a warm-up, an oscillation, a frozen tensor, plain
SGD and AdamW) is not flagged."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from opalctl.formats import RecordDamaged
from opalctl.opal import integrity
from opalctl.opal.integrity import IntegrityRecorder, sample_indices, sample_sizes

torch.set_num_threads(1)

WEIGHT = "0.weight"


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def batch(update: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 + update % 64)
    x = torch.randn(16, 10, generator=generator)
    return x, x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(16, 1, generator=generator)


def train(steps: int, *, evals=(), lr=lambda u: 0.05, hook=None, optimizer: str = "sgd", model=None,
          recorder=None, start: int = 1, frozen: tuple[str, ...] = ()):
    """``steps`` updates of a small MLP; after the optimizer step of update ``u`` ``hook(u, params)`` runs (the
    'program' that moves tensors), then ``record(u)``; an evaluation after the updates in ``evals``. Returns the
    findings (checks due during the run, then the rest flushed), the recorder and the model."""
    model = model or make_model()
    for name in frozen:
        dict(model.named_parameters())[name].requires_grad_(False)
    params = dict(model.named_parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "sgd":
        opt = torch.optim.SGD(trainable, lr=lr(start))
    else:
        opt = torch.optim.AdamW(trainable, lr=lr(start))
    if recorder is None:
        recorder = IntegrityRecorder(params, start=start - 1)
    findings = []
    for u in range(start, start + steps):
        for group in opt.param_groups:
            group["lr"] = lr(u)
        x, y = batch(u)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if hook is not None:
            with torch.no_grad():
                hook(u, params)
        recorder.record(u)
        if u in evals:
            recorder.open_check(u)
        found = recorder.maybe_check(u)
        if found is not None:
            findings.extend(found)
    findings.extend(recorder.flush() or [])
    return findings, recorder, model


def kinds(findings, kind):
    return [f for f in findings if f["kind"] == kind]


def delta_for(name: str, params, scale: float = 0.05, seed: int = 7) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(params[name].shape, generator=generator)


# -- the sample --------------------------------------------------------------------------------------------------
def test_sample_sizes_obey_the_limits():
    assert sample_sizes([5, 100, 10**6]) == [5, 100, 1024]
    many = sample_sizes([10**6] * 40)
    assert sum(many) == 32768 and max(many) <= 1024 and min(many) >= 819
    shared = sample_sizes([2000] * 100)
    assert sum(shared) == 32768 and set(shared) <= {327, 328}
    # small tensors keep their whole share; what they leave goes to the large ones
    mixed = sample_sizes([10] * 50 + [10**6] * 40)
    assert mixed[:50] == [10] * 50 and sum(mixed) == 32768 and max(mixed) <= 1024
    assert sample_sizes([10, 10, 10]) == [10, 10, 10]  # the whole model, under the minimum
    assert sum(sample_sizes([100, 100], per_tensor=4)) == 32  # the minimum wins over a tiny per-tensor cap
    crowd = sample_sizes([1] * 40000)
    assert sum(crowd) == 32768 and max(crowd) == 1
    for numels in ([40], [33], [64, 1], [1000, 3, 3], [10**5] * 3):
        sizes = sample_sizes(numels)
        assert sum(sizes) >= min(32, sum(numels)) and sum(sizes) <= 32768
        assert all(s <= min(n, 1024) for s, n in zip(sizes, numels))


def test_recorder_budget_on_a_large_model():
    params = {f"layer{i}.weight": torch.zeros(50, 40) for i in range(40)}
    params["bias"] = torch.zeros(7)
    recorder = IntegrityRecorder(params)
    counts = recorder.sample_counts
    assert sum(counts.values()) == 32768
    assert max(counts.values()) <= 1024 and counts["bias"] == 7
    assert recorder.groups[0].ring.shape == (128 + 8 + 2, 32768)


def test_sample_indices_are_seeded_unique_and_in_range():
    a = sample_indices("w", 10**6, 1024, seed=3)
    assert len(np.unique(a)) == 1024 and a.min() >= 0 and a.max() < 10**6 and (np.diff(a) > 0).all()
    assert np.array_equal(a, sample_indices("w", 10**6, 1024, seed=3))
    assert not np.array_equal(a, sample_indices("w", 10**6, 1024, seed=4))
    assert not np.array_equal(a, sample_indices("v", 10**6, 1024, seed=3))
    assert np.array_equal(sample_indices("b", 10, 1024), np.arange(10))


# -- the ring: layouts, dtypes, no host synchronisation ----------------------------------------------------------
def layout_params() -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(1)
    params = {
        "transposed": torch.nn.Parameter(torch.randn(30, 50).t()),
        "channels_last": torch.nn.Parameter(torch.randn(6, 3, 5, 7).to(memory_format=torch.channels_last)),
        "sliced": torch.nn.Parameter(torch.randn(20, 80)[:, ::2]),
        "permuted": torch.nn.Parameter(torch.randn(4, 5, 6).permute(2, 0, 1)),
        "contiguous": torch.nn.Parameter(torch.randn(40, 40)),
        "scalar": torch.nn.Parameter(torch.tensor(0.5)),
    }
    assert not params["transposed"].is_contiguous()
    assert not params["channels_last"].is_contiguous()
    assert params["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert not params["sliced"].is_contiguous() and not params["permuted"].is_contiguous()
    return params


def assert_sampled(recorder: IntegrityRecorder, params, update: int) -> None:
    values = recorder.values_at(update)
    assert values is not None and set(values) == set(params)
    for name, param in params.items():
        index = torch.from_numpy(recorder.indices(name))
        expected = param.detach().reshape(-1)[index].double().numpy()  # logical order, whatever the layout
        assert np.array_equal(values[name], expected), name


def test_non_contiguous_and_channels_last_parameters_are_sampled_at_their_logical_entries():
    params = layout_params()
    recorder = IntegrityRecorder(params, start=0)
    assert recorder.sample_counts["transposed"] == 1024 and recorder.sample_counts["scalar"] == 1
    assert_sampled(recorder, params, 0)
    with torch.no_grad():
        for param in params.values():
            param.mul_(3).add_(1)  # in place: the layouts stay
    recorder.record(1)
    assert_sampled(recorder, params, 1)
    # a program that swaps the storage (another layout, another place) is followed
    params["transposed"].data = params["transposed"].detach().contiguous() * 2
    params["channels_last"].data = params["channels_last"].detach().contiguous() - 1
    params["contiguous"].data = params["contiguous"].detach().t().contiguous().t()
    params["contiguous"].data = torch.randn(40, 40).t()  # same shape, transposed strides
    recorder.record(2)
    assert_sampled(recorder, params, 2)


def test_one_gather_per_ring_and_the_per_tensor_copies_record_the_same(monkeypatch):
    params = layout_params()
    fast = IntegrityRecorder(params, start=0)
    assert all(group.alias is not None for group in fast.groups)
    monkeypatch.setattr(integrity, "_alias", lambda *args: None)  # as on a device without an alias
    slow = IntegrityRecorder(params, start=0)
    monkeypatch.undo()
    assert all(group.alias is None for group in slow.groups)
    for group in slow.groups:
        group.trusted = False  # stays on the per-tensor copies after a storage swap too
    for update in (1, 2):
        with torch.no_grad():
            for param in params.values():
                param.add_(1)
        if update == 2:
            params["channels_last"].data = params["channels_last"].detach().contiguous()
        fast.record(update)
        slow.record(update)
        assert_sampled(fast, params, update)
        assert_sampled(slow, params, update)
    assert all(group.alias is None for group in slow.groups)
    assert all(group.alias is not None for group in fast.groups)  # rebuilt after the storage swap


def test_bfloat16_and_float32_tensors_have_exact_rings_of_their_own_dtype():
    torch.manual_seed(2)
    params = {"half": torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16)),
              "full": torch.nn.Parameter(torch.randn(64, 64))}
    recorder = IntegrityRecorder(params, start=5)
    assert sorted(str(g.dtype) for g in recorder.groups) == ["torch.bfloat16", "torch.float32"]
    assert_sampled(recorder, params, 5)


def test_a_shape_change_leaves_the_update_out_instead_of_failing():
    params = {"w": torch.nn.Parameter(torch.randn(10, 10))}
    recorder = IntegrityRecorder(params, start=0)
    original = params["w"].data
    params["w"].data = torch.randn(5, 20)
    recorder.record(1)
    assert recorder.values_at(1) == {}
    params["w"].data = original
    recorder.record(2)
    assert_sampled(recorder, params, 2)


def test_a_storage_freed_under_a_parameter_is_left_out_not_read():
    params = {"w": torch.nn.Parameter(torch.randn(64, 64)), "b": torch.nn.Parameter(torch.randn(64))}
    recorder = IntegrityRecorder(params, start=0)
    kept = params["w"].detach().clone()
    params["w"].untyped_storage().resize_(0)
    recorder.record(1)
    assert set(recorder.values_at(1)) == {"b"}
    params["w"].data = kept
    params["w"].data = params["w"].data.t().contiguous().t()
    recorder.record(2)
    assert_sampled(recorder, params, 2)


HOST_SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::to", "aten::_to_copy", "aten::copy_",
                 "aten::tolist", "aten::nonzero", "aten::is_nonzero", "aten::equal", "aten::allclose"}


def profiled_ops(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [event.name for event in prof.events()]


def test_record_makes_no_host_synchronisation(monkeypatch):
    params = layout_params()
    recorder = IntegrityRecorder(params, start=0)

    def forbidden(*args, **kwargs):
        raise AssertionError("record() read a tensor on the host")

    names = []
    for update in range(1, 6):
        with torch.no_grad():
            for param in params.values():
                param.add_(0.01)
        monkeypatch.setattr(torch.Tensor, "item", forbidden)
        for method in ("tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
            monkeypatch.setattr(torch.Tensor, method, forbidden)
        names += profiled_ops(lambda u=update: (recorder.record(u), recorder.maybe_check(u)))
        monkeypatch.undo()
    assert not set(names) & HOST_SYNC_OPS, set(names) & HOST_SYNC_OPS
    # one gather per ring and update, nothing else on the steady path
    assert set(names) == {"aten::index_select"}, set(names)
    assert names.count("aten::index_select") == 5 * len(recorder.groups) == 5
    # a storage swapped by a program: the view is rebuilt on the device, still without a host read
    params["transposed"].data = params["transposed"].detach().contiguous()
    names = profiled_ops(lambda: recorder.record(6))
    assert not set(names) & HOST_SYNC_OPS, set(names) & HOST_SYNC_OPS
    monkeypatch.undo()
    assert_sampled(recorder, params, 6)


def round_trip_hook(t: int, also=None):
    """A hook that moves WEIGHT away at update ``t`` and back at ``t + 1`` (``also(u, params)`` runs too)."""
    holder = {}

    def hook(u, params):
        if u == t:
            holder["delta"] = delta_for(WEIGHT, params)
            params[WEIGHT].add_(holder["delta"])
        elif u == t + 1:
            params[WEIGHT].sub_(holder["delta"])
        elif also is not None:
            also(u, params)

    return hook


# -- the rules -----------------------------------------------------------------------------------------------------
def test_a_round_trip_around_an_evaluation_is_flagged_naming_the_tensor_and_both_updates():
    t = 150
    hook = round_trip_hook(t)
    findings, recorder, _ = train(200, evals=(50, 100, t), hook=hook)
    trips = kinds(findings, "round_trip")
    assert len(trips) == 1, findings
    trip = trips[0]
    assert (trip["tensor"], trip["evaluated_at"], trip["away"], trip["back"]) == (WEIGHT, t, t, t + 1)
    assert trip["distance"] >= 0.5 * trip["jump"] and trip["residual"] <= 0.25 * trip["distance"]
    assert recorder.pending == []


def test_a_round_trip_a_few_updates_before_and_after_is_flagged():
    t = 140

    def hook(u, params):
        if u == t - 3:
            params["2.weight"].add_(delta_for("2.weight", params, 0.2))
        elif u == t + 5:
            params["2.weight"].sub_(delta_for("2.weight", params, 0.2))

    findings, _, _ = train(170, evals=(t,), hook=hook)
    trips = kinds(findings, "round_trip")
    assert [(f["tensor"], f["away"], f["back"]) for f in trips] == [("2.weight", t - 3, t + 5)]


def test_a_round_trip_by_swapping_the_storage_is_flagged():
    t = 150
    saved = {}

    def hook(u, params):
        if u == t:
            saved["data"] = params["0.bias"].data
            params["0.bias"].data = saved["data"] + 0.3
        elif u == t + 1:
            params["0.bias"].data = saved["data"]

    findings, _, _ = train(180, evals=(t,), hook=hook)
    assert [(f["tensor"], f["away"], f["back"]) for f in kinds(findings, "round_trip")] == [("0.bias", t, t + 1)]


def excursion(name, away, back, amount):
    """A hook that moves tensor ``name`` by ``amount`` after update ``away`` and back after update ``back``."""

    def hook(u, params):
        if u == away:
            params[name].add_(amount)
        elif u == back:
            params[name].sub_(amount)

    return hook


def test_a_round_trip_on_a_frozen_tensor_is_flagged():
    t = 60
    findings, _, _ = train(80, evals=(t,), hook=excursion("0.bias", t, t + 2, 0.5), frozen=("0.bias",))
    assert [(f["tensor"], f["away"], f["back"]) for f in kinds(findings, "round_trip")] == [("0.bias", t, t + 2)]


def test_a_round_trip_in_a_tensor_of_few_entries_is_information_only():
    t = 60
    findings, _, _ = train(80, evals=(t,), hook=excursion("2.bias", t, t + 1, 1.0))
    assert kinds(findings, "round_trip") == []
    small = kinds(findings, "round_trip_small")
    assert [(f["tensor"], f["away"], f["back"], f["samples"]) for f in small] == [("2.bias", t, t + 1, 1)]
    assert integrity.summarise(findings)["flagged"] is False


def test_the_same_move_without_the_return_is_information_only():
    t = 150

    def hook(u, params):
        if u == t:
            params[WEIGHT].add_(delta_for(WEIGHT, params))

    findings, _, _ = train(200, evals=(t,), hook=hook)
    assert kinds(findings, "round_trip") == []
    lasting = kinds(findings, "lasting_jump")
    assert [(f["tensor"], f["away"], f["evaluated_at"]) for f in lasting] == [(WEIGHT, t, t)]
    assert "back" not in lasting[0]


def test_a_marked_discontinuity_is_not_judged():
    t = 150

    def hook(u, params):
        if u == t:
            params[WEIGHT].add_(delta_for(WEIGHT, params))
        elif u == t + 1:
            params[WEIGHT].sub_(delta_for(WEIGHT, params))

    model = make_model()
    recorder = IntegrityRecorder(dict(model.named_parameters()))
    recorder.discontinuity(t + 1)  # the optimizer restored a state there, say
    findings, _, _ = train(200, evals=(t,), hook=hook, model=model, recorder=recorder)
    assert kinds(findings, "round_trip") == []


EVALS = tuple(range(20, 400, 20)) + (99, 100, 101, 103, 199, 200, 201, 204, 208)


def test_ordinary_sgd_training_is_not_flagged():
    findings, _, _ = train(400, evals=EVALS)
    assert kinds(findings, "round_trip") == []


def test_ordinary_adamw_training_is_not_flagged():
    findings, _, _ = train(400, evals=EVALS, optimizer="adamw", lr=lambda u: 3e-3)
    assert kinds(findings, "round_trip") == []


@pytest.mark.parametrize("factor", [10.0, 0.1, 30.0])
def test_a_sustained_learning_rate_change_is_not_flagged(factor):
    base = 0.02 if factor > 1 else 0.05
    findings, _, _ = train(400, evals=EVALS, lr=lambda u: base * (factor if u >= 200 else 1.0))
    assert kinds(findings, "round_trip") == []


def test_a_schedule_with_restarts_is_not_flagged():
    findings, _, _ = train(400, evals=EVALS + tuple(range(55, 400, 60)) + tuple(range(61, 400, 60)),
                           lr=lambda u: 0.05 * (1 - (u % 60) / 60))
    assert kinds(findings, "round_trip") == []


def test_a_learning_rate_change_is_jumps_in_a_stretch():
    # the change at 200 makes every later update a jump against the window's median: a stretch, not a round trip
    findings, recorder, _ = train(210, evals=(201,), lr=lambda u: 0.002 * (30.0 if u >= 200 else 1.0))
    assert kinds(findings, "round_trip") == [] and kinds(findings, "lasting_jump") == []


@pytest.mark.parametrize("warmup", ["linear", "step", "exponential"])
def test_a_warm_up_is_not_flagged(warmup):
    def lr(u):
        if warmup == "linear":
            return 0.05 * min(1.0, u / 100)
        if warmup == "step":
            return 0.0005 if u < 30 else 0.05
        return 0.05 * min(1.0, 1.1 ** (u - 60))

    evals = tuple(range(5, 200, 5))
    findings, _, _ = train(200, evals=evals, lr=lr)
    assert kinds(findings, "round_trip") == []


def test_an_oscillation_is_not_flagged():
    generator = torch.Generator().manual_seed(5)
    direction = {}

    def hook(u, params):
        if not direction:
            direction.update({name: torch.randn(p.shape, generator=generator) for name, p in params.items()})
        sign = 1.0 if u % 2 else -1.0
        size = 0.05 * (1.0 + 0.2 * float(torch.rand((), generator=generator)))
        for name, p in params.items():
            p.add_(direction[name] * sign * size)

    findings, _, _ = train(300, evals=tuple(range(10, 300, 7)), hook=hook, lr=lambda u: 0.0)
    assert kinds(findings, "round_trip") == []
    findings, _, _ = train(300, evals=tuple(range(10, 300, 7)), hook=hook)  # on top of training
    assert kinds(findings, "round_trip") == []


def test_a_frozen_tensor_produces_no_jumps():
    findings, _, _ = train(200, evals=tuple(range(10, 200, 10)), frozen=("0.bias", "2.weight"))
    assert not [f for f in findings if f["tensor"] in ("0.bias", "2.weight")]
    # a model where nothing moves at all
    findings, _, _ = train(100, evals=tuple(range(10, 100, 10)), lr=lambda u: 0.0)
    assert findings == []


def test_a_tensor_that_starts_training_late_is_not_flagged():
    def hook(u, params):
        if u < 120:
            params["2.weight"].copy_(start["2.weight"])

    model = make_model()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    findings, _, _ = train(200, evals=(119, 120, 121, 125, 140), hook=hook, model=model)
    assert kinds(findings, "round_trip") == []


# -- when checks run, resume, switching off ----------------------------------------------------------------------
def test_the_check_runs_once_the_window_after_is_recorded():
    params = {"w": torch.nn.Parameter(torch.zeros(100))}
    recorder = IntegrityRecorder(params, window_before=16, window_after=4, start=0)
    for u in range(1, 30):
        with torch.no_grad():
            params["w"].add_(0.01)
        recorder.record(u)
        if u == 10:
            recorder.open_check(10)
        result = recorder.maybe_check(u)
        if u < 14:
            assert result is None, u
        elif u == 14:
            assert result == [] and recorder.checked == [10]
        else:
            assert result is None
    assert recorder.flush() is None


def test_state_dict_resumes_the_ring_and_the_pending_checks():
    t = 100
    whole, _, _ = train(130, evals=(t,), hook=round_trip_hook(t))
    assert len(kinds(whole, "round_trip")) == 1

    # the same run, saved after update 104 (the check at 100 still pending) and resumed by a new recorder
    model = make_model()
    recorder = IntegrityRecorder(dict(model.named_parameters()))
    hook = round_trip_hook(t)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for u in range(1, 105):
        x, y = batch(u)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        with torch.no_grad():
            hook(u, params)
        recorder.record(u)
        if u == t:
            recorder.open_check(u)
        assert recorder.maybe_check(u) is None
    buffer = io.BytesIO()
    torch.save(recorder.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = IntegrityRecorder(params, start=None)
    resumed.load_state_dict(saved)
    assert resumed.pending == [t]
    findings, _, _ = train(26, start=105, hook=hook, model=model, recorder=resumed)
    assert findings == whole

    with pytest.raises(RecordDamaged):
        IntegrityRecorder(params, window_before=64).load_state_dict(saved)
    with pytest.raises(RecordDamaged):
        IntegrityRecorder({"other": torch.nn.Parameter(torch.zeros(3))}).load_state_dict(saved)


def test_a_disabled_recorder_does_nothing():
    params = {"w": torch.nn.Parameter(torch.zeros(10))}
    recorder = IntegrityRecorder(params, enabled=False)
    recorder.record(1)
    recorder.open_check(1)
    assert recorder.slot_update.count(None) == recorder.rows
    assert recorder.pending == [] and recorder.maybe_check(100) is None and recorder.flush() is None
    recorder.enabled = True
    recorder.record(2)
    assert recorder.values_at(2) is not None


def test_pointer_only_records_still_follow_new_memory_and_never_read_freed_memory():
    # record(layouts=False) is what the agent optimizer uses while the released starting program runs: only the
    # data pointers are compared, which is enough for memory safety and for a parameter given new memory
    params = {"w": torch.nn.Parameter(torch.randn(64, 64)), "b": torch.nn.Parameter(torch.randn(64))}
    recorder = IntegrityRecorder(params, start=0)
    params["w"].data = torch.randn(64, 64)
    recorder.record(1, layouts=False)
    assert_sampled(recorder, params, 1)
    with torch.no_grad():
        params["b"].add_(1.0)  # in place, same memory: the same offsets see the new values
    recorder.record(2, layouts=False)
    assert_sampled(recorder, params, 2)
    params["w"].untyped_storage().resize_(0)
    recorder.record(3, layouts=False)
    assert set(recorder.values_at(3)) == {"b"}


def test_the_one_gather_per_ring_and_its_plain_twin_record_the_same_samples_and_findings():
    """``alias=False`` copies every tensor on its own: the same rows bit for bit, and the same findings, through a
    round trip and a tensor given new memory (which rebuilds the gather plan)."""
    t = 150

    def new_memory(u, params):
        if u == 120:
            params["2.bias"].data = params["2.bias"].detach().clone()  # new memory: the plan is made again

    hook = round_trip_hook(t, also=new_memory)

    runs = {}
    for alias in (True, False):
        model = make_model()
        recorder = IntegrityRecorder(dict(model.named_parameters()), start=0, alias=alias)
        runs[alias] = train(200, evals=(50, 100, t), hook=hook, model=model, recorder=recorder)
    (fast_findings, fast, _), (plain_findings, plain, _) = runs[True], runs[False]
    assert all(group.alias is not None for group in fast.groups)
    assert all(group.alias is None for group in plain.groups)
    assert kinds(fast_findings, "round_trip") and fast_findings == plain_findings
    for a, b in zip(fast.groups, plain.groups):
        assert torch.equal(a.ring.view(torch.int32), b.ring.view(torch.int32))  # bit for bit
    assert fast.slot_update == plain.slot_update and fast.gaps == plain.gaps
    for update in range(200 - fast.rows + 1, 201):
        fast_values, plain_values = fast.values_at(update), plain.values_at(update)
        assert fast_values.keys() == plain_values.keys()
        assert all(np.array_equal(fast_values[name], plain_values[name]) for name in fast_values)
