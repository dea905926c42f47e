"""What an arm's runs flag about themselves reaches every verdict of that arm (compare/flags.py): the evaluation
integrity check, programs that failed or hung, CPU spent outside the charged updates, and, as a note, an agent arm
that ran without the operating system's confinement."""

from __future__ import annotations

from opalctl.compare.flags import OUTSIDE_SLACK_SECONDS, outside_cpu, outside_work_flag, run_flags, unconfined_note
from opalctl.compare.verdict import verdict


def report(*, train_cpu=2.0, process_cpu=2.5, flagged=0, reverted=0, agent=True, confinement="landlock"):
    out = {"seconds": {"train_cpu": train_cpu}, "process": {"cpu_seconds": process_cpu},
           "confinement": None if confinement is None else {"mechanism": confinement}}
    out["agent"] = {"decisions_reverted": reverted, "eval_integrity": {"flagged": flagged}} if agent else None
    return out


def test_a_clean_arm_raises_no_flag():
    assert run_flags({1: report(), 2: report()}, {1: 0, 2: 0}) == []
    assert outside_work_flag({1: report()}, {1: report(agent=False)}) is None


def test_each_flag_names_the_seeds_it_happened_on():
    flags = run_flags({1: report(flagged=1), 2: report(reverted=2), 3: report()}, {1: 0, 2: 0, 3: 1})
    assert flags == [
        "evaluation integrity: a program moved the parameters for an evaluation and back on seed 1, so those stage "
        "metrics are not of the weights it trained",
        "2 program version(s) failed and were reverted on seed 2",
        "1 program version(s) hung on seed 3 (the run ended and was resumed without them)"]


def test_cpu_outside_the_charged_updates_is_flagged_only_past_the_baselines_by_a_clear_margin():
    baseline = {1: report(train_cpu=2.0, process_cpu=2.4, agent=False), 2: report(agent=False)}
    assert abs(outside_cpu(baseline[1]) - 0.4) < 1e-9
    honest = {1: report(train_cpu=2.0, process_cpu=2.4 + OUTSIDE_SLACK_SECONDS * 0.9), 2: report()}
    assert outside_work_flag(honest, baseline) is None
    # a program that trained off the budget: 3 CPU-seconds the charged updates never saw, on seed 1
    hidden = {1: report(train_cpu=2.0, process_cpu=5.4), 2: report()}
    flag = outside_work_flag(hidden, baseline)
    assert flag is not None and "3.0 CPU-s more" in flag and "seed 1 " in flag
    # without the kernel's count (an older report) nothing is claimed either way
    assert outside_work_flag({1: {"seconds": {"train_cpu": 1.0}}}, baseline) is None


def test_the_verdict_of_a_flagged_arm_ends_with_its_flags():
    figure = {"n": 3, "differences": [1.0, 2.0, 3.0], "mean_difference": 2.0, "wins": 3, "losses": 0,
              "p_value": 0.25, "p_exact": True, "higher_is_better": True, "seeds_needed": None}
    plain = verdict("agent", "adamw", "selection.correct", figure)
    flagged = verdict("agent", "adamw", "selection.correct", figure, ["2 program version(s) failed"])
    assert flagged == plain + " Flagged: 2 program version(s) failed."


def test_an_unconfined_agent_arm_gets_a_note_and_a_plain_arm_none():
    assert "ran without the operating system's confinement on seed 2" in unconfined_note(
        "agent", {1: report(), 2: report(confinement="none")})
    assert unconfined_note("agent", {1: report(confinement=None)}) is not None
    assert unconfined_note("adamw", {1: report(agent=False, confinement=None)}) is None
    assert unconfined_note("agent", {1: {"agent": {}}}) is None  # an older report does not say
