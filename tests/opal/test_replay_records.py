"""The replay backend reads the original run's events through ``opalctl.formats.read_jsonl``."""

from __future__ import annotations

import json

import pytest


def _records(folder, events: list[str]):
    records = folder / "opal"
    version = records / "programs" / "v001"
    version.mkdir(parents=True)
    (version / "updater.py").write_text("# updater v1\n")
    (version / "analysis.py").write_text("# analysis v1\n")
    (records / "events.jsonl").write_text("".join(events))
    return folder


APPLIED = json.dumps({"kind": "applied", "decision": 1, "update": 5, "version": 1, "rationale": "why"}) + "\n"
FAILED = json.dumps({"kind": "decision_failed", "decision": 2, "update": 9, "message": "boom"}) + "\n"
LATE = json.dumps({"kind": "late", "decision": 3, "update": 12}) + "\n"


@pytest.mark.parametrize("torn", ['{"kind": "applied", "decis', "7"])
def test_a_replay_skips_a_last_line_cut_short_by_a_crash_of_the_original(tmp_path, torn):
    from opalctl.opal.agents.replay import ReplayBackend

    backend = ReplayBackend(_records(tmp_path / "run", [APPLIED, FAILED, LATE, torn]))
    assert sorted(backend.plan) == [1, 2] and backend.describe()["decisions"] == 2
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    answer = backend.decide(workspace, "message", {"decision": 1})
    assert answer.failed is None and (workspace / "updater.py").read_text() == "# updater v1\n"
    assert answer.rationale.splitlines()[0].endswith("decision 1 applied version 1.")
    assert "boom" in backend.decide(workspace, "message", {"decision": 2}).failed
    assert "answered no decision 3" in backend.decide(workspace, "message", {"decision": 3}).rationale


def test_a_replay_refuses_original_events_damaged_in_the_middle(tmp_path):
    from opalctl.formats import RecordDamaged
    from opalctl.opal.agents.replay import ReplayBackend

    with pytest.raises(RecordDamaged, match="events.jsonl line 2 is not JSON"):
        ReplayBackend(_records(tmp_path / "run", [APPLIED, "{garbage\n", FAILED]))
