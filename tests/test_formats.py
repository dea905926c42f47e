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
    AgentFigures,
    Event,
    RecordDamaged,
    RunReport,
    StageRecord,
    StepRow,
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
