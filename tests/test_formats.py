"""``opalctl.formats``: the records every module and process share. The hand-formatted steps line is the bytes of its
plain twin; a record lacking a field, or of another format, is refused in one sentence naming it; the JSONL reader
skips only a last line cut short by a crash."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from opalctl.formats import (
    FORMAT_VERSION,
    Acknowledged,
    AgentFigures,
    CarriedStages,
    Closed,
    Event,
    Message,
    Opening,
    RecordDamaged,
    RecordedStage,
    RunReport,
    SelectedRecord,
    StageFacts,
    StageReached,
    StageRecord,
    StageSaved,
    StageVerdict,
    Starting,
    StepRow,
    TrainingFacts,
    read_jsonl,
    step_line,
    step_line_plain,
)

finite = st.floats(allow_nan=False, allow_infinity=False)
digest = st.text(alphabet="0123456789abcdef", min_size=16, max_size=32)


@given(update=st.integers(min_value=0, max_value=2**62), charge=finite, used=finite, wall=finite, loss=finite,
       rows=digest, seen=digest, cpu_charges=st.booleans())
def test_the_hand_formatted_steps_line_is_the_bytes_of_json_dumps(update, charge, used, wall, loss, rows, seen,
                                                                    cpu_charges):
    fast = step_line(update, charge, used, wall, loss, rows, seen, cpu_charges)
    assert fast == step_line_plain(update, charge, used, wall, loss, rows, seen, cpu_charges)
    assert json.loads(fast)["loss"] == loss


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_loss_is_written_by_the_plain_twin_and_reads_back(loss):
    line = step_line(3, 1.0, 3.0, 0.01, loss, "a" * 16, "b" * 32, False)
    value = json.loads(line)["loss"]
    assert (math.isnan(value) and math.isnan(loss)) or value == loss


def test_the_steps_line_has_the_documented_keys_and_the_row_its_fields():
    line = json.loads(step_line(1, 1.0, 1.0, 0.5, 2.0, "r" * 16, "s" * 32, True))
    assert list(line) == ["charge", "cpu", "loss", "lrs", "rows", "seen", "update", "used", "wall"]
    assert line["cpu"] == 1.0 and line["lrs"] is None
    assert StepRow._fields == ("update", "charge", "used", "wall", "loss", "ids", "lrs")


@given(lrs=st.one_of(st.none(), st.lists(st.one_of(st.none(), st.floats()), max_size=4)), loss=finite)
def test_the_learning_rates_in_a_steps_line_are_the_bytes_of_json_dumps_and_read_back(lrs, loss):
    fast = step_line(2, 1.0, 2.0, 0.1, loss, "a" * 16, "b" * 32, False, lrs)
    assert fast == step_line_plain(2, 1.0, 2.0, 0.1, loss, "a" * 16, "b" * 32, False, lrs)
    expected = None if lrs is None else [x if x is not None and math.isfinite(x) else None for x in lrs]
    assert json.loads(fast)["lrs"] == expected


def stage(**changes):
    record = dict(stage=1, fraction=0.5, update=10, budget_used=10.0, budget_fraction_used=0.5, examples=640,
                  train_cpu_seconds=1.0, train_wall_seconds=1.1, checkpoint={"file": "stage-01.pt"},
                  metrics={"selection.correct": 3}, eval_seconds=0.1, incumbent_before="anchor",
                  decision={"promoted": True, "reasons": []}, promoted=True, incumbent_after=1,
                  shared_state_with=[], loss=0.5)
    record.update(changes)
    return record


def test_a_stage_record_round_trips_and_carries_its_format():
    record = StageRecord.from_json(stage())
    assert record.to_json() == {**stage(), "format": FORMAT_VERSION}
    assert StageRecord.from_json(record.to_json()) == record


def test_a_record_written_before_versioning_reads_as_version_one_and_unknown_keys_are_ignored():
    assert StageRecord.from_json({**stage(), "later_key": 1}).format == 1


def test_a_record_lacking_a_field_is_refused_naming_the_record_and_the_fields():
    data = stage()
    del data["metrics"], data["loss"]
    with pytest.raises(RecordDamaged, match=r"runs/x/stage-01.json lacks metrics, loss; the record is damaged"):
        StageRecord.from_json(data, "runs/x/stage-01.json")


def test_a_record_of_another_format_or_not_an_object_is_refused():
    with pytest.raises(RecordDamaged, match="has format 2"):
        StageRecord.from_json({**stage(), "format": 2})
    with pytest.raises(RecordDamaged, match="is not a JSON object"):
        RunReport.from_json([1, 2])


def test_agent_figures_report_step_failures():
    names = [f for f in AgentFigures.__dataclass_fields__]
    assert "step_failures" in names and "decisions_reverted" in names


def test_event_kinds_hold_every_outcome_and_no_kind_that_is_never_written():
    assert set(Event.OUTCOMES) <= Event.ALL and set(Event.ANSWERED) <= set(Event.OUTCOMES)
    assert "rejected" not in Event.ALL


def test_the_jsonl_reader_skips_a_torn_last_line_only(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "start"}\n{"kind": "end"}\n{"kind": "tor')
    assert [e["kind"] for e in read_jsonl(path)] == ["start", "end"]
    path.write_text('{"kind": "start"}\n\n{"kind": "end"}\n')
    assert [e["kind"] for e in read_jsonl(path)] == ["start", "end"]


def test_the_jsonl_reader_refuses_a_damaged_line_before_the_last_naming_file_and_line(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "start"}\nnot json\n{"kind": "end"}\n')
    with pytest.raises(RecordDamaged, match=r"events.jsonl line 2 is not JSON"):
        list(read_jsonl(path))
    path.write_text('{"kind": "start"}\n[1]\n')
    with pytest.raises(RecordDamaged, match=r"line 2 is not a JSON object"):
        list(read_jsonl(path))


def test_the_jsonl_reader_names_a_missing_file(tmp_path):
    with pytest.raises(RecordDamaged, match=r"nothing.jsonl is missing"):
        list(read_jsonl(tmp_path / "nothing.jsonl"))


# -- the evaluator's messages ------------------------------------------------------------------------------------

FACTS = StageFacts(update=10, budget_used=10.0, budget_fraction_used=0.5, examples=640, train_cpu_seconds=1.0,
                   train_wall_seconds=1.1, loss=float("nan"))
TRAINING = TrainingFacts(updates=20, budget_total=20.0, budget_used=20.0, overshoot=0.0, ledger={"resumes": 0},
                         rows_digest="ab", agent=None, final_model_sha256="cd", peak_memory_bytes=1,
                         peak_device_memory_bytes=None, session_wall=1.0, session_cpu=1.0)
MESSAGES = {
    Message.OPEN: (Opening(lock="l.lock.json", lock_sha256="ab", arm="adamw", seed=1, run_dir="r", anchor_dir="a",
                           sys_path=["/x"]), Acknowledged()),
    Message.START: (Starting(confinement=None, initial={"file": "initial.pt", "sha256": "ab", "model_sha256": "cd"},
                             inherited=None, initialised=["w"], groups=None, host="h"), Acknowledged()),
    Message.CARRIED: (CarriedStages(stages=2, update=10), Acknowledged()),
    Message.STAGE: (StageReached(saved=[StageSaved(index=1, sha256="ab", model_sha256="cd", bytes=9)], facts=FACTS),
                    StageVerdict(stages=[RecordedStage(stage=2, said="promoted")])),
    Message.CLOSE: (TRAINING, Closed(report={"updates": 20})),
}


@pytest.mark.parametrize("kind", Message.ALL)
def test_each_message_and_its_answer_is_a_record_that_crosses_the_pipe_and_reads_back_the_same(kind):
    body, answer = MESSAGES[kind]
    assert isinstance(body, Message.BODIES[kind]) and isinstance(answer, Message.ANSWERS[kind])
    for record in (body, answer):
        again = type(record).from_json(json.loads(json.dumps(record.to_json(), allow_nan=True)))
        assert json.dumps(again.to_json(), allow_nan=True) == json.dumps(record.to_json(), allow_nan=True)


def test_a_stage_message_lacking_a_field_is_refused_naming_it():
    data = MESSAGES[Message.STAGE][0].to_json()
    del data["saved"][0]["model_sha256"]
    with pytest.raises(RecordDamaged, match="a stage checkpoint sent lacks model_sha256"):
        StageReached.from_json(data)
    with pytest.raises(RecordDamaged, match="the evaluator's verdict on a stage is not a JSON object"):
        StageVerdict.from_json({"stages": {}})


def test_a_stage_record_gives_back_the_facts_it_took_over_and_names_its_checkpoint():
    record = StageRecord.from_json(stage(checkpoint={"file": "training/stage-01.pt", "sha256": "ab",
                                                     "model_sha256": "cd", "bytes": 9}))
    assert StageFacts.of(record).fields() == {key: stage()[key] for key in FACTS.fields()}
    assert StageSaved.of(0, record.checkpoint) == StageSaved(index=0, sha256="ab", model_sha256="cd", bytes=9)


def test_a_selected_stage_has_no_reason_and_the_report_says_source_stage_and_flag():
    chosen = SelectedRecord(source="stage", stage=2, flagged=False, checkpoint={"file": "x"}, metrics={})
    assert list(chosen.to_json()) == ["source", "stage", "flagged", "checkpoint", "metrics"]
    anchor = SelectedRecord(source="anchor", stage=None, flagged=True, checkpoint={}, metrics={}, reason="none")
    assert anchor.to_json()["reason"] == "none"
    assert chosen.summary() == {"source": "stage", "stage": 2, "flagged": False}
