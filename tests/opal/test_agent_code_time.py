"""Every second agent code runs in the training process is counted (``guard.AgentCodeTime``): inside the timed
updates (a program's steps and its analysis) or outside them (its top level and ``build()`` at a decision,
``state_dict()`` at a checkpoint, ``load_state_dict()`` at a resume). ``take_outside_charge()`` hands the outside
seconds to the formal run, which charges them to the budget; the totals are in the agent figures. The released
starting program is the user's own optimizer: nothing of it is counted."""

from __future__ import annotations

import time

import pytest

from opalctl.formats import AgentFigures
from opalctl.opal import wrap

STEPS = 40
AT = 0.125  # the decision falls before update 5
BURN = '''
def burn():
    total = 0
    for i in range(BURN_ITERATIONS):
        total += i * i
    return total

'''
BURN_ITERATIONS = 3_000_000  # about 0.3 s of one core here (the test measures it)


def burn_cpu_seconds() -> float:
    """The CPU seconds the programs' ``burn()`` takes when this test runs it itself: the least of three, since on a
    loaded machine the same loop's CPU seconds vary by a third from one run to the next (0.085 counted against a
    single 0.123 here once). The tests ask for half of it where it is counted, and keep 0.7 of it as the line under
    which what holds no burn stays."""
    namespace: dict = {}
    exec(compile(f"BURN_ITERATIONS = {BURN_ITERATIONS}\n" + BURN, "burn", "exec"), namespace)
    seconds = []
    for _ in range(3):
        started = time.process_time()
        namespace["burn"]()
        seconds.append(time.process_time() - started)
    return min(seconds)


def burning_updater(opal, where: str) -> str:
    """Plain SGD whose ``build()`` (``where="build"``) burns the CPU once."""
    source = opal.sgd_updater(build_body="    burn()" if where == "build" else "")
    return source.replace("import torch\n", f"import torch\n\nBURN_ITERATIONS = {BURN_ITERATIONS}\n{BURN}", 1)


def test_cpu_burnt_in_build_at_a_decision_is_charged_outside_the_updates(opal, run_dir):
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=burning_updater(opal, "build")),
                     decisions=1, schedule=[AT], total_steps=STEPS, run_dir=run_dir, manual_boundaries=True)
    opal.train(model, optimizer, 4, between=True)
    assert optimizer.take_outside_charge() == (0.0, 0.0)  # the starting program is the user's optimizer
    opal.train(model, optimizer, 2, start=4, between=True)  # the decision at update 5: v001 is built
    assert optimizer.current.number == 1
    cpu, wall = optimizer.take_outside_charge()
    burnt = burn_cpu_seconds()
    assert cpu >= 0.5 * burnt and wall >= 0.5 * burnt, (cpu, wall, burnt)
    assert optimizer.take_outside_charge() == (0.0, 0.0)  # taken once
    figures = optimizer.figures()["agent_code_seconds"]
    assert figures["outside_updates"] == {"cpu": cpu, "wall": wall}
    assert 0 < figures["inside_updates"]["cpu"] < 0.7 * burnt  # v001's one step so far: counted, and small


def test_cpu_burnt_in_the_analysis_is_counted_inside_the_updates(opal, run_dir):
    analysis = (f"EVERY = 5\nBURN_ITERATIONS = {BURN_ITERATIONS}\n{BURN}def analyze(obs, memory):\n    burn()\n"
                "    return {'report': {}}\n")
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=opal.sgd_updater(), analysis=analysis),
                     decisions=1, schedule=[AT], total_steps=STEPS, run_dir=run_dir, manual_boundaries=True)
    opal.train(model, optimizer, 10, between=True)  # v001 from update 5; its analysis after update 9
    burnt = burn_cpu_seconds()
    figures = optimizer.figures()["agent_code_seconds"]
    assert figures["inside_updates"]["cpu"] >= 0.5 * burnt and figures["inside_updates"]["wall"] >= 0.5 * burnt, \
        (figures, burnt)
    cpu, wall = optimizer.take_outside_charge()
    assert cpu < 0.7 * burnt and cpu == figures["outside_updates"]["cpu"]  # its top levels and build() only
    optimizer.close()
    end = opal.of_kind(opal.events(run_dir), "end")[0]
    assert end["agent_code_seconds"] == optimizer.figures()["agent_code_seconds"]
    assert AgentFigures.from_json(optimizer.figures()).agent_code_seconds == optimizer.figures()["agent_code_seconds"]


def test_the_starting_program_is_never_counted_and_the_totals_survive_a_resume(opal, run_dir, tmp_path):
    model = opal.make_model()
    kept = wrap(opal.adamw(model), model, backend="keep", total_steps=STEPS, run_dir=run_dir)
    opal.train(model, kept, 30)
    kept.state_dict()
    zero = {"cpu": 0.0, "wall": 0.0}
    assert kept.figures()["agent_code_seconds"] == {"inside_updates": zero, "outside_updates": zero}

    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, backend=opal.Writer(updater=opal.sgd_updater()), decisions=1,
                     schedule=[AT], total_steps=STEPS, run_dir=tmp_path / "a")
    opal.train(model, optimizer, 10)
    state = optimizer.state_dict()
    before = state["agent_code_seconds"]
    assert before["inside_updates"]["cpu"] > 0 and before["outside_updates"]["wall"] > 0
    resumed = wrap(opal.adamw(model), model, backend=opal.Writer(), decisions=1, schedule=[AT], total_steps=STEPS,
                   run_dir=tmp_path / "a")
    resumed.load_state_dict(state)
    after = resumed.figures()["agent_code_seconds"]
    # the sessions before, plus this one's: v001 installed again (its top levels, build and load_state_dict)
    assert after["inside_updates"] == before["inside_updates"]
    assert after["outside_updates"]["wall"] > before["outside_updates"]["wall"]
    this_session = after["outside_updates"]["wall"] - before["outside_updates"]["wall"]
    assert resumed.take_outside_charge()[1] == pytest.approx(this_session)
