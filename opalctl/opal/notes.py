"""Notes a person leaves for a run's agent (``opalctl say RUN_DIR "text"``), and how the training process reads them.

A note is one file of the run folder, ``notes/NNN.json`` (``formats.NoteRecord``: its number from 1, the text, who
left it as user@host, and when, UTC), written by ``say`` atomically (a temporary file renamed) under the lock of
the notes folder, so two notes left at once take two numbers. The training process of an agent arm whose protocol
allows notes (``agent: {notes: allowed}``, frozen in the lock) reads, each time it asks a decision, the notes after
the last one it read, in order, and shows them in the decision's message and facts; the decision's ``requested``
event names each (number, who, when), so the records say which decision saw which note, and the agent host's record
of the request holds the text as the agent got it. The training process may read the notes folder, never write
it (``driver/run.py`` confines it so), and reads it as hostile: each note by its name, never a listing, never
through a link (``files.read_beneath``), a regular file of at most ``MAX_NOTE_FILE_BYTES``, of the record's shape
and number, at most ``NOTES_PER_DECISION`` at a decision and ``MAX_NOTES`` in a run. A note it refuses is never
shown; the event says why.

A person in the loop changes what a comparison measures: ``compare`` flags every arm whose runs received notes
(``notes_flag``), and the report page carries the flag with the verdicts.

``say`` refuses, in one sentence and exit 2: a folder that is not a started run's, a run of an arm without an agent,
a run whose protocol does not allow notes (a formal run's protocol is frozen: allowing them is a new protocol), a
finished run (no decision is left to read it), an empty or overlong text.
"""

from __future__ import annotations

import datetime
import fcntl
import getpass
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput, OpalctlError
from opalctl.files import NotAPlainFile, atomic_write_json, read_beneath, storage
from opalctl.formats import Event, NoteRecord, StartRecord, decode_record, read_jsonl, read_record
from opalctl.layout import FINISHED, RunLayout

MAX_NOTE_CHARS = 2000
MAX_NOTE_FILE_BYTES = 16384
MAX_NOTES = 100
NOTES_PER_DECISION = 10
ALLOWED = "allowed"  # the protocol's ``agent.notes`` that allows them
LOCK_NAME = ".lock"
NOTE_NAME = re.compile(r"^([0-9]{3})\.json$")


@dataclass
class NotesTaken:
    """What one decision read of the notes: those it shows, a sentence for each it refused, and the number of the
    last one it read (shown or refused), from which the next decision reads on."""

    notes: list[NoteRecord]
    refused: list[str]
    last: int

    def shown(self) -> list[dict[str, Any]]:
        """The notes as the decision's facts carry them."""
        return [{"note": note.note, "who": note.who, "at": note.at, "text": note.text} for note in self.notes]

    def named(self) -> list[dict[str, Any]]:
        """The notes as the decision's event names them (the text is in the message)."""
        return [{"note": note.note, "who": note.who, "at": note.at} for note in self.notes]


def read_new(folder: Path, after: int, limit: int = NOTES_PER_DECISION) -> NotesTaken:
    """The notes of ``folder`` numbered after ``after``, in order, up to the first missing number and at most
    ``limit`` of them (the module docstring says how each is checked)."""

    folder = Path(folder)
    notes: list[NoteRecord] = []
    refused: list[str] = []
    last = after
    if folder.is_symlink():  # the folder itself is read beneath, never through a link (its notes are by name)
        return NotesTaken([], [f"the notes folder {folder} is a link; no note is read"], last)
    for number in range(after + 1, min(after + limit, MAX_NOTES) + 1):
        try:
            # beneath the notes folder itself: the confined training process may read that folder alone
            data = read_beneath(folder, f"{number:03d}.json", MAX_NOTE_FILE_BYTES)
        except NotAPlainFile as why:  # a link, a FIFO, a device, a second name, over the limit: never shown
            refused.append(f"note {number} was refused: {why}")
            last = number
            continue
        except OSError:  # missing (not left yet), or not readable now: the next decision reads from here again
            break
        last = number
        value, why = decode_record(data)
        try:
            if why is not None:
                raise ValueError(why)
            note = NoteRecord.from_json(value, what=f"note {number}")
        except (ValueError, OpalctlError) as error:
            refused.append(f"note {number} was refused: {error}")
            continue
        if note.note != number or len(note.text) > MAX_NOTE_CHARS or not note.text.strip():
            refused.append(f"note {number} was refused: its number or its text is not one `opalctl say` writes")
            continue
        notes.append(note)
    return NotesTaken(notes, refused, last)


def taken_numbers(folder: Path) -> list[int]:
    """The numbers of the notes in ``folder`` (by their names), in order."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(match.group(1)) for name in names if (match := NOTE_NAME.match(name)))


def notes_allowed(arm_config: dict[str, Any] | None) -> bool:
    """Whether an arm (a lock's resolved arm) takes notes: an agent arm whose protocol allows them."""
    agent = (arm_config or {}).get("agent")
    return isinstance(agent, dict) and agent.get("notes") == ALLOWED


def say(run_dir: str | os.PathLike, text: str) -> dict[str, Any]:
    """Leave ``text`` as a note for the agent of the run in ``run_dir``: the note's record, with its path."""

    layout = RunLayout.of(run_dir)
    root = layout.root
    if not layout.start.is_file():
        raise BadInput(f"{root} is not the folder of a run that has started (it has no start.json); leave a note in "
                       f"the folder of an agent arm's run (runs/NAME-SHA12/ARM/seed-S) once it has started")
    start = read_record(layout.start, StartRecord)
    if not (start.arm_config or {}).get("agent"):
        raise BadInput(f"{root} is a run of arm {start.arm}, which has no agent: there is no one to leave a note for")
    if not notes_allowed(start.arm_config):
        raise BadInput(f"{root}: the protocol of arm {start.arm} does not allow notes (a person's note changes what "
                       f"the comparison measures); to allow them, freeze a protocol whose arm has `agent: {{notes: "
                       f"allowed}}`")
    if layout.state == FINISHED:
        raise BadInput(f"{root} is finished: its agent asks no more decisions, so no note would be read")
    if not isinstance(text, str) or not text.strip():
        raise BadInput("the note is empty; give the text to show the agent, e.g. opalctl say RUN_DIR \"...\"")
    if len(text) > MAX_NOTE_CHARS or "\0" in text:
        raise BadInput(f"the note is {len(text)} characters long or holds a NUL byte; a note is at most "
                       f"{MAX_NOTE_CHARS} characters of text")
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    folder = layout.notes
    then = "run `opalctl say` again"
    with storage(folder, then=then):
        folder.mkdir(exist_ok=True)
        lock = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        number = max(taken_numbers(folder), default=0) + 1
        if number > MAX_NOTES:
            raise BadInput(f"{root} holds {MAX_NOTES} notes already, the most a run reads; no more can be left")
        note = NoteRecord(note=number, text=text, who=who, at=at)
        path = layout.note_file(number)
        with storage(path, then=then):
            atomic_write_json(path, note.to_json())
            os.chmod(path, 0o644)  # read by the training process, which may run as another user than the person
    finally:
        os.close(lock)
    return {"run_dir": str(root), "path": str(path), **note.to_json()}


def notes_flag(run_dirs: dict[int, Path]) -> tuple[str | None, dict[str, dict[str, int]]]:
    """The flag of an arm whose runs (seed -> run folder) received notes (None when none did), and per seed how many
    notes were left and how many a decision showed (``requested`` events naming them)."""

    counted: dict[str, dict[str, int]] = {}
    for seed, run_dir in sorted(run_dirs.items()):
        layout = RunLayout(run_dir)
        left = len(taken_numbers(layout.notes))
        if not left:
            continue
        shown = 0
        try:
            for event in read_jsonl(layout.events):
                if event.get("kind") == Event.REQUESTED and isinstance(event.get("notes"), list):
                    shown += len(event["notes"])
        except (OSError, OpalctlError):
            pass  # no events to read: the notes left still count
        counted[str(seed)] = {"left": left, "shown": shown}
    if not counted:
        return None, {}
    seeds = sorted(int(seed) for seed in counted)
    left = sum(c["left"] for c in counted.values())
    shown = sum(c["shown"] for c in counted.values())
    return (f"a person left {left} note(s) for the agent on seed{'s' if len(seeds) > 1 else ''} "
            f"{', '.join(map(str, seeds))} ({shown} shown at a decision): a human in the loop, so these runs do not "
            f"measure the agent alone"), counted
