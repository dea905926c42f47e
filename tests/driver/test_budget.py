import json
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opalctl.driver.budget import (
    CLOCKS,
    BudgetMeter,
    BudgetMismatch,
    BudgetSpent,
    ChargingClock,
    Clock,
    CpuClock,
    GpuClock,
    PendingCharge,
    TrainingBudget,
    UnknownClock,
    UpdatesClock,
    WallClock,
    clock_spec,
    make_clock,
)
from opalctl.errors import BadInput, OpalctlError
from opalctl.formats import RecordDamaged


class FakeClock(Clock):
    """Charges a scripted list of amounts, one per interval."""

    name = "fake"

    def __init__(self, charges):
        self.charges = list(charges)
        self.open = 0

    def start(self):
        self.open += 1
        return self.open

    def stop(self, token):
        assert token == self.open
        return self.charges.pop(0)


def run(meter, clock, limit=10_000):
    """The budget loop without training: {update number: boundaries reported at it}."""
    reports = {}
    while not meter.done and limit:
        limit -= 1
        reached = meter.charge(clock.stop(clock.start()))
        if reached:
            reports[meter.updates] = reached
    return reports


def test_boundaries_at_exact_fractions():
    meter = BudgetMeter(4.0, [0.25, 0.5, 0.75, 1.0])
    assert run(meter, FakeClock([1.0] * 4)) == {1: [0], 2: [1], 3: [2], 4: [3]}
    assert meter.done and meter.overshoot == 0.0 and meter.used == 4.0 and meter.fraction_used == 1.0


def test_one_slow_update_reports_every_boundary_it_crosses():
    meter = BudgetMeter(10.0, [0.25, 0.5, 0.75, 1.0])
    assert run(meter, FakeClock([1.0, 6.0, 1.0, 3.0])) == {2: [0, 1], 3: [2], 4: [3]}


def test_one_update_may_spend_the_whole_budget():
    meter = BudgetMeter(1.0, [0.25, 0.5, 0.75, 1.0])
    assert meter.charge(5.0) == [0, 1, 2, 3]
    assert meter.done and meter.overshoot == 4.0


def test_overshoot_is_the_last_updates_excess():
    meter = BudgetMeter(10.0, [0.5, 1.0])
    run(meter, FakeClock([4.0, 4.0, 3.5]))
    assert meter.updates == 3 and meter.used == 11.5 and meter.overshoot == 1.5
    meter = BudgetMeter(10.0, [0.5, 1.0])
    meter.charge(9.0)
    assert meter.overshoot == 0.0 and not meter.done


def test_updates_clock_on_ten_updates():
    meter = BudgetMeter(10, [0.25, 0.5, 0.75, 1.0])
    reports = run(meter, UpdatesClock())
    assert reports == {3: [0], 5: [1], 8: [2], 10: [3]}
    assert meter.updates == 10 and meter.overshoot == 0.0


def test_whole_updates_land_where_the_fraction_says():
    # 0.28 * 25 is 7.000000000000001 in floating point; the boundary must still be update 7
    meter = BudgetMeter(25, [0.28, 0.56, 1.0])
    assert run(meter, UpdatesClock()) == {7: [0], 14: [1], 25: [2]}


@pytest.mark.parametrize(("clock", "charged"), [(UpdatesClock, 0.0), (CpuClock, 0.25), (WallClock, 2.0)])
def test_agent_code_outside_the_updates_is_charged_once_with_the_next_update_at_its_clocks_price(clock, charged):
    """0.25 CPU seconds over 2 wall seconds of a program's build(): the next update carries what the clock prices
    them at (CPU seconds, wall seconds, or nothing on the updates clock), and the one after it nothing more."""
    pending = PendingCharge()
    budget = TrainingBudget(BudgetMeter(100.0, [1.0]), ChargingClock(UpdatesClock(), pending), pending,
                            clock.agent_code_charge)
    budget.charge_agent_code(0.25, 2.0)
    assert pending.amount == charged
    assert [budget.clock.stop(budget.clock.start()) for _ in range(2)] == [1.0 + charged, 1.0]
    assert pending.amount == 0.0


def test_zero_charges_are_allowed_but_never_reach_a_boundary():
    meter = BudgetMeter(2.0, [0.5, 1.0])
    assert meter.charge(0.0) == [] and meter.updates == 1


def test_charge_after_done_raises():
    meter = BudgetMeter(1.0, [1.0])
    meter.charge(1.0)
    with pytest.raises(BudgetSpent, match="spent after update 1"):
        meter.charge(1.0)


@pytest.mark.parametrize("amount", [-1.0, float("nan"), float("inf")])
def test_bad_charges_are_refused(amount):
    with pytest.raises(ValueError, match="finite number >= 0"):
        BudgetMeter(1.0, [1.0]).charge(amount)


@pytest.mark.parametrize("total, fractions", [(0, [1.0]), (float("inf"), [1.0]), (1, [0.5, 0.5, 1.0]),
                                              (1, [0.0, 1.0]), (1, [0.5, 1.5])])
def test_bad_meters_are_refused(total, fractions):
    with pytest.raises(ValueError):
        BudgetMeter(total, fractions)


def test_state_round_trip_mid_run_continues_exactly():
    charges = [0.3, 0.7, 2.9, 0.1, 0.1, 1.3, 0.05, 2.2, 0.4, 1.1, 0.9]
    fractions = [0.1, 0.2, 0.25, 0.5, 0.75, 1.0]
    whole = BudgetMeter(7.3, fractions)
    expected = run(whole, FakeClock(charges))

    first = BudgetMeter(7.3, fractions)
    reports = {}
    for amount in charges[:4]:
        if reached := first.charge(amount):
            reports[first.updates] = reached
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = BudgetMeter(7.3, fractions)
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == first.state_dict()
    reports.update(run(resumed, FakeClock(charges[4:])))
    assert reports == expected
    assert resumed.used == whole.used and resumed.overshoot == whole.overshoot and resumed.updates == whole.updates


def test_state_of_another_budget_is_refused_as_an_opalctl_error():
    meter = BudgetMeter(10, [0.5, 1.0])
    with pytest.raises(BudgetMismatch, match="not this run's"):
        meter.load_state_dict(BudgetMeter(20, [0.5, 1.0]).state_dict())


@settings(max_examples=200, deadline=None)
@given(charges=st.lists(st.floats(min_value=1e-6, max_value=50.0), min_size=1, max_size=60),
       fractions=st.lists(st.floats(min_value=1e-3, max_value=1.0), min_size=1, max_size=8, unique=True),
       total=st.floats(min_value=0.5, max_value=100.0))
def test_every_boundary_reported_once_in_order(charges, fractions, total):
    fractions = sorted(fractions)
    meter = BudgetMeter(total, fractions)
    reported = []
    clock = FakeClock(charges)
    while not meter.done and clock.charges:
        before = meter.fraction_used
        reached = meter.charge(clock.stop(clock.start()))
        for k in reached:
            assert meter.fraction_used >= fractions[k] > before
            assert meter.used >= fractions[k] * total * (1 - 1e-12)
        reported += reached
    assert reported == list(range(len(reported)))  # each once, in order
    assert all(meter.fraction_used < f for f in fractions[len(reported):])
    if meter.done:
        assert meter.used >= total and meter.overshoot == meter.used - total
        if fractions[-1] == 1.0:
            assert reported == list(range(len(fractions)))


def test_real_clocks_measure_intervals():
    for clock in (CpuClock(), WallClock()):
        token = clock.start()
        sum(range(10_000))
        assert clock.stop(token) >= 0.0
    assert UpdatesClock().stop(UpdatesClock().start()) == 1.0
    assert [make_clock(n).name for n in ("cpu", "wall", "updates")] == ["cpu", "wall", "updates"]
    with pytest.raises(UnknownClock, match="unknown budget clock 'tpu'; set budget.clock to one of cpu, gpu, wall, "
                                           "updates"):
        make_clock("tpu")


class FakeEvent:
    log: list = []

    def __init__(self, enable_timing):
        assert enable_timing
        self.at = None

    def record(self, stream):
        self.log.append(("record", stream))
        self.at = len(self.log)

    def synchronize(self):
        self.log.append(("synchronize", self.at))

    def elapsed_time(self, end):
        return 250.0 * (end.at - self.at)  # milliseconds


def fake_torch(available):
    cuda = types.SimpleNamespace(is_available=lambda: available, Event=FakeEvent,
                                 current_stream=lambda device: f"stream:{device}")
    return types.SimpleNamespace(cuda=cuda, device=lambda spec: types.SimpleNamespace(type=str(spec).split(":")[0],
                                                                                          spec=spec))


def test_gpu_clock_records_synchronises_and_charges_seconds(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(True))
    FakeEvent.log = []
    clock = make_clock("gpu", "cuda:0")
    token = clock.start()
    FakeEvent.log.append(("work", None))
    assert clock.stop(token) == 0.5  # two log entries apart: 500 ms
    assert [entry[0] for entry in FakeEvent.log] == ["record", "work", "record", "synchronize"]


def test_gpu_clock_without_cuda_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(False))
    with pytest.raises(OpalctlError, match="no CUDA device"):
        GpuClock()


def test_a_damaged_saved_state_is_refused_as_a_damaged_record():
    meter = BudgetMeter(10, [0.5, 1.0])
    state = {**meter.state_dict(), "used": -1.0}
    with pytest.raises(RecordDamaged, match="saved budget state is damaged"):
        meter.load_state_dict(state)


def test_the_registry_lists_every_clock_in_the_order_a_protocol_error_names_them():
    assert list(CLOCKS) == ["cpu", "gpu", "wall", "updates"]
    assert all(clock_spec(name).name == name for name in CLOCKS)
    with pytest.raises(BadInput, match="unknown budget clock 'tpu'"):
        clock_spec("tpu")


def test_each_clock_declares_what_the_run_pilot_and_compare_need():
    declared = {name: (spec.cpu_charges, spec.needs_cuda, spec.compare_seconds) for name, spec in CLOCKS.items()}
    assert declared == {"cpu": (True, False, "train_cpu_seconds"), "gpu": (False, True, "train_wall_seconds"),
                        "wall": (False, False, "train_wall_seconds"), "updates": (False, False, "train_cpu_seconds")}
    # the pilot's projection: cpu seconds for the cpu clock, wall seconds for the timed others, the count itself
    assert clock_spec("cpu").projected_updates(10.0, 0.5, 0.25) == 20.0
    assert clock_spec("wall").projected_updates(10.0, 0.5, 0.25) == 40.0
    assert clock_spec("gpu").projected_updates(10.0, 0.5, 0.25) == 40.0
    assert clock_spec("updates").projected_updates(10.0, 0.5, 0.25) == 10.0
    assert clock_spec("wall").projected_updates(10.0, 0.5, 0.0) == float("inf")
    assert "on 3 thread(s)" in clock_spec("cpu").limitation(3)
    assert all(clock_spec(name).limitation(1).endswith(".") for name in CLOCKS)


def test_a_new_clock_is_one_registered_class(monkeypatch):
    from opalctl.driver import budget

    monkeypatch.setattr(budget, "CLOCKS", dict(budget.CLOCKS))

    @budget.register
    class HalfClock(budget.Clock):
        name = "half"

        @classmethod
        def limitation(cls, threads):
            return "The half clock charges half an update."

        def start(self):
            return None

        def stop(self, token):
            return 0.5

    assert clock_spec("half") is HalfClock
    assert make_clock("half").stop(None) == 0.5
