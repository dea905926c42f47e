"""The decision counts of compare/decisions.py and the rules built on them, on decisions shaped as ``opalctl show``
reads them from a run folder (``driver/show.agent_decisions``); the runs themselves are
tests/driver/test_agent_never_acted.py's."""

from __future__ import annotations

from opalctl.compare.decisions import ArmDecisions, DecisionTally, RunEnding, agent_warnings, never_answered
from opalctl.compare.verdict import verdict
from opalctl.errors import EXIT_AGENT_NEVER_ANSWERED


def entry(number: int, outcome: str, message: str | None = None, reverted_at: int | None = None) -> dict:
    return {"decision": number, "asked_at": 10 * number, "reason": "scheduled", "outcome": outcome,
            "message": message, "reverted_at": reverted_at}


APPLIED, KEPT = entry(1, "applied"), entry(2, "kept")
REFUSED = entry(3, "decision_failed", "failed: the API refused the key (HTTP 401); check ANTHROPIC_API_KEY")
SLOW = entry(4, "decision_failed", "the decision ran past its limit of 300 s and was stopped")


def test_the_counts_partition_the_decisions_asked():
    tally = DecisionTally.of_entries([
        APPLIED, entry(2, "applied", reverted_at=40), KEPT, REFUSED, SLOW, entry(6, "load_failed", "SyntaxError"),
        entry(7, "late", "the answer arrived after the last update and was not applied"), entry(8, "pending"),
        entry(9, "decision_failed", "the claude command ran past the decision's limit of 60 s")])
    assert (tally.asked, tally.applied, tally.rolled_back, tally.kept, tally.failed, tally.timed_out) == \
        (9, 2, 1, 1, 2, 4)
    assert tally.asked == tally.applied + tally.kept + tally.failed + tally.timed_out
    assert tally.acted and tally.answered


def test_the_most_frequent_failure_is_named_without_its_failed_prefix():
    tally = DecisionTally.of_entries([REFUSED, entry(5, "decision_failed", REFUSED["message"]), SLOW])
    assert tally.failure == "the API refused the key (HTTP 401); check ANTHROPIC_API_KEY" and tally.failures == 2
    assert tally.said() == ("0 of 3 decisions applied, 2 failed, 1 timed out (the API refused the key (HTTP 401); "
                            "check ANTHROPIC_API_KEY; 2 said so)")


def arm(**seeds: list[dict]) -> ArmDecisions:
    return ArmDecisions("agent", "AdamW", {int(seed.removeprefix("s")): DecisionTally.of_entries(entries)
                                           for seed, entries in seeds.items()})


def test_an_arm_that_never_acted_gets_the_sentence_in_place_of_its_verdict():
    failed = arm(s1=[REFUSED, REFUSED], s2=[REFUSED, SLOW])
    said = failed.instead_of_verdict
    assert said == ("agent arm agent never acted: 0 of 4 decisions applied, 3 failed, 1 timed out (the API refused "
                    "the key (HTTP 401); check ANTHROPIC_API_KEY; 3 said so) on 2 seeds; its runs are the base "
                    "optimizer's (AdamW), so a verdict would be about AdamW, not the agent.")
    assert failed.left_out_seeds == [] and failed.never_answered_seeds == [1, 2]
    figure = {"n": 2, "differences": [0.0, 0.0]}
    assert verdict("agent", "adamw", "selection.correct", figure, ["2 programs hung"], failed) == \
        said + " Flagged: 2 programs hung."
    # kept everywhere: answered, but never acted either
    assert arm(s1=[KEPT], s2=[KEPT]).instead_of_verdict.startswith(
        "agent arm agent never acted: 0 of 2 decisions applied, 2 kept on 2 seeds;")


def test_a_mixed_arm_leaves_out_the_seeds_whose_agent_never_answered_and_names_those_that_only_kept():
    mixed = arm(s1=[APPLIED, KEPT], s2=[REFUSED], s3=[KEPT], s4=[])
    assert mixed.instead_of_verdict is None
    assert (mixed.acted_seeds, mixed.declined_seeds, mixed.left_out_seeds) == ([1], [3], [2, 4])
    assert mixed.note == (" Seeds 2, 4 left out: the agent of agent never answered there (0 of 1 decision applied, 1 "
                          "failed (the API refused the key (HTTP 401); check ANTHROPIC_API_KEY)), so those runs are "
                          "AdamW alone; on seed 3 the agent answered but changed nothing (0 of 1 decision applied, 1 "
                          "kept); counted, as the agent's choice.")
    figure = {"n": 1, "differences": [1.0], "mean_difference": 1.0}
    said = verdict("agent", "adamw", "selection.correct", figure, None, mixed)
    assert said.startswith("agent vs adamw on selection.correct: +1 on the one common seed") and \
        said.endswith(mixed.note)
    assert arm(s1=[APPLIED], s2=[APPLIED]).note == ""


def test_a_grid_or_demo_reads_the_warnings_and_the_exit_from_a_comparison():
    rows = [{"arm": "adamw", "decisions": None},
            {"arm": "agent", "decisions": arm(s1=[REFUSED], s2=[REFUSED]).to_json()},
            {"arm": "mixed", "decisions": arm(s1=[APPLIED], s2=[SLOW]).to_json()},
            {"arm": "fine", "decisions": arm(s1=[APPLIED]).to_json()}]
    warnings = agent_warnings({"arms": rows})
    assert [w.split(":")[0] for w in warnings] == ["agent arm agent never acted", "agent arm mixed"]
    assert never_answered({"arms": rows}) and not never_answered({"arms": [rows[0], rows[3]]})


def test_a_fixed_arm_ends_its_run_with_nothing_to_say(tmp_path):
    ending = RunEnding.of("adamw", 1, {"optimizer": {"name": "AdamW"}}, tmp_path)
    assert (ending.decisions, ending.warning, ending.exit_code) == (None, None, 0)
    assert EXIT_AGENT_NEVER_ANSWERED == 5


def test_the_demo_says_the_sentence_in_place_of_an_agent_arms_verdict():
    """The demo prints compare's verdicts (compare/aggregate.py words them with each arm's decisions)."""
    from opalctl import demo
    from opalctl.compare.statistics import paired
    from opalctl.compare.verdict import verdict

    base = {1: 50.0, 2: 52.0, 3: 51.0}
    figure = paired(base, dict(base), resamples=200)
    never, mixed = arm(s1=[REFUSED], s2=[REFUSED], s3=[REFUSED]), arm(s1=[APPLIED], s2=[APPLIED], s3=[SLOW])
    moved = paired(base, {1: 51.0, 2: 53.0}, resamples=200)
    figure["verdict"] = verdict("agent", "hot", "selection.correct", figure, None, never)
    moved["verdict"] = verdict("mixed", "hot", "selection.correct", moved, None, mixed)
    comparison = {"primary": "selection.correct", "baseline": "hot", "arms": [
        {"arm": "hot", "paired": {}, "decisions": None},
        {"arm": "agent", "paired": {"selection.correct": figure}, "decisions": never.to_json()},
        {"arm": "mixed", "paired": {"selection.correct": moved}, "decisions": mixed.to_json()}]}
    sentences = demo.verdict(comparison)
    assert sentences[0] == never.to_json()["no_verdict"] and "no difference" not in " ".join(sentences)
    assert sentences[1].startswith("mixed vs hot on selection.correct: +1 ") and mixed.to_json()["note"] in sentences[1]
