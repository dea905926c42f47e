"""The notes a person leaves for the agent (opalctl/opal/notes.py): what the training process reads of a hostile
notes folder, what ``opalctl say`` refuses, and the message a note makes. The run that receives a note mid-training
is tests/driver/test_notes.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from opalctl.opal.messages import render
from opalctl.opal.notes import MAX_NOTE_CHARS, MAX_NOTE_FILE_BYTES, read_new
from tests.support.cli import call_cli


def _note(folder, number, text="slow down", **more):
    folder.mkdir(exist_ok=True)
    record = {"note": number, "text": text, "who": "ada@login", "at": "2026-12-03T10:00:00Z", "format": 1, **more}
    (folder / f"{number:03d}.json").write_text(json.dumps(record))


def test_the_training_side_reads_notes_in_order_and_refuses_hostile_ones(tmp_path):
    notes = tmp_path / "notes"
    _note(notes, 1, "first")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"note": 2, "text": "planted", "who": "x", "at": "y"}))
    (notes / "002.json").symlink_to(tmp_path / "elsewhere.json")  # a link
    (notes / "003.json").write_bytes(b"{" + b" " * MAX_NOTE_FILE_BYTES + b"}")  # oversized
    os.mkfifo(notes / "004.json")  # a FIFO, never waited on
    (notes / "005.json").write_text("not json")  # malformed
    _note(notes, 6, "numbered as another")
    (notes / "006.json").write_text((notes / "006.json").read_text().replace('"note": 6', '"note": 9'))
    _note(notes, 7, "x" * (MAX_NOTE_CHARS + 1))  # longer than say writes
    _note(notes, 8, "last")
    os.link(notes / "008.json", tmp_path / "second-name.json")  # a second name: refused too
    _note(notes, 9, "ninth")
    _note(notes, 11, "after a gap")  # not read: 10 is missing
    taken = read_new(notes, 0, limit=20)
    assert [note.text for note in taken.notes] == ["first", "ninth"]
    assert taken.last == 9
    assert len(taken.refused) == 7
    assert "note 2 was refused: it is a symbolic link" in taken.refused
    assert any(r.startswith("note 3 was refused: it is") and "over the limit" in r for r in taken.refused)
    assert "note 4 was refused: it is not a regular file" in taken.refused
    assert "note 8 was refused: it has 2 names (a hard link)" in taken.refused
    again = read_new(notes, taken.last)  # the next decision reads from there: nothing new until 10 is left
    assert again.notes == [] and again.last == 9
    _note(notes, 10, "tenth")
    assert [note.text for note in read_new(notes, 9).notes] == ["tenth", "after a gap"]


def test_a_notes_folder_that_is_a_link_is_not_read(tmp_path):
    real = tmp_path / "real"
    _note(real, 1, "through a link")
    (tmp_path / "notes").symlink_to(real)
    taken = read_new(tmp_path / "notes", 0)
    assert taken.notes == [] and "is a link" in taken.refused[0]


def test_a_missing_notes_folder_has_no_notes(tmp_path):
    taken = read_new(tmp_path / "notes", 0)
    assert taken.notes == [] and taken.refused == [] and taken.last == 0


def test_the_message_shows_the_notes_of_its_decision():
    facts = {"decision": 2, "reason": "scheduled", "update": 5, "progress": 0.5, "remaining": 1, "lrs": [0.1],
             "losses": {"bins": []}}
    sources = {"updater.py": "u", "analysis.py": "a"}
    assert "Notes from a person" not in render(facts, sources)
    shown = render({**facts, "notes": [{"note": 3, "who": "ada@login", "at": "2026-12-03T10:00:00Z",
                                        "text": "mind the spike"}]}, sources)
    assert "- note 3, from ada@login at 2026-12-03T10:00:00Z: mind the spike" in shown


@pytest.mark.parametrize("arm, sentence", [
    ("adamw", "which has no agent: there is no one to leave a note for"),
    ("agent", "does not allow notes"),
])
def test_say_refuses_a_run_that_takes_no_notes(finished_runs, tmp_path, arm, sentence):
    run_dir = tmp_path / "seed-1"
    shutil.copytree(finished_runs["base"] / arm / "seed-1", run_dir)
    result = call_cli("say", run_dir, "hello")
    assert result.code == 2, result.output
    assert sentence in result.stderr and result.stderr.count("\n") == 1
    assert not (run_dir / "notes").exists()


def test_say_refuses_a_folder_that_is_no_run(tmp_path):
    result = call_cli("say", tmp_path, "hello")
    assert result.code == 2 and "is not the folder of a run that has started" in result.stderr


def test_say_refuses_an_empty_or_overlong_note(finished_runs, tmp_path):
    run_dir = tmp_path / "seed-1"
    shutil.copytree(finished_runs["base"] / "agent" / "seed-1", run_dir)
    start = json.loads((run_dir / "start.json").read_text())
    start["arm_config"]["agent"]["notes"] = "allowed"
    (run_dir / "start.json").write_text(json.dumps(start))
    (run_dir / "report.json").unlink()  # as a run that is still training
    for text, sentence in (("  ", "the note is empty"), ("x" * (MAX_NOTE_CHARS + 1), "at most 2000 characters")):
        result = call_cli("say", run_dir, text)
        assert result.code == 2 and sentence in result.stderr, result.output
    assert not list((run_dir / "notes").glob("*.json"))  # nothing written
    left = call_cli("say", run_dir, "one", "--json")
    second = call_cli("say", run_dir, "two", "--json")
    assert (left.code, second.code) == (0, 0), left.output + second.output
    assert [left.json()["note"], second.json()["note"]] == [1, 2]
    assert [note.text for note in read_new(run_dir / "notes", 0).notes] == ["one", "two"]


def test_wrap_shows_each_note_once_and_a_resume_does_not_show_it_again(opal, tmp_path):
    """The library: ``wrap(..., notes_dir=)`` shows a note at the next decision only, and a run resumed from a
    ``state_dict`` taken after a note was shown does not show it again (nor skip one left since)."""
    from opalctl.opal import wrap

    notes = tmp_path / "notes"
    messages = []

    def agent(workspace, message):
        messages.append(message)
        return "Observed: the loss.\nKept: nothing to change."

    options = dict(backend=agent, decisions=3, schedule=[0.1, 0.4, 0.8], total_steps=100, notes_dir=notes)
    model = opal.make_model()
    optimizer = wrap(opal.adamw(model), model, run_dir=tmp_path / "a", **options)
    _note(notes, 1, "left before the first decision")
    opal.train(model, optimizer, 30)
    state = optimizer.state_dict()
    _note(notes, 2, "left after the checkpoint")
    resumed_model = opal.make_model()
    resumed_model.load_state_dict(model.state_dict())
    resumed = wrap(opal.adamw(resumed_model), resumed_model, run_dir=tmp_path / "b", **options)
    resumed.load_state_dict(state)
    opal.train(resumed_model, resumed, 70, start=30)
    resumed.close()
    optimizer.close()
    assert len(messages) == 3
    assert "left before the first decision" in messages[0]
    assert "left before the first decision" not in messages[1] + messages[2]
    assert "left after the checkpoint" in messages[1] and "left after the checkpoint" not in messages[2]
