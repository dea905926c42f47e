"""The agent's records: the training process's own account under ``RUN_DIR`` (``OpalRecords``; a formal run puts it
at ``<run>/training/opal/``), the agent host's under its own folder (``HostRecords``; ``<run>/agent/``), and the
redactions every writer goes through.

The training process's (``OpalRecords``), its claim of what ran:

    events.jsonl     one JSON object per line, its type in ``kind`` (one of ``opalctl.formats.Event``: start,
                     requested, applied, kept, load_failed, trial_passed, reverted, failed_step, wake, end, ...)
    losses.jsonl     the loss binned per analysis interval (update, mean, min, max, count, non-finite count)
    reports.jsonl    every analysis report
    programs/vNNN/   each version of updater.py and analysis.py, as loaded
    decisions/NNN/   meta.json (timing, outcome, the sha256 of the programs it was answered); for a backend that
                     answers in this process (``keep``, a callable given to ``wrap()``), also message.md (what the
                     agent read), response.md (its rationale) and transcript.json, which no host records
    workspace/       where such a backend edits the programs

The agent host's (``HostRecords``), written by the host process, which no agent program runs in, into a folder the
confined training process cannot write; each decision as the host saw it:

    decisions/NNN/   the request as received (message.md, facts.json, running/updater.py, running/analysis.py),
                     the answer (response.md, the rationale; transcript.json; answer.json, a
                     ``formats.HostDecisionRecord``) and the programs answered (updater.py, analysis.py); written
                     whole under a temporary name and renamed; a record of the same number an earlier session
                     made is moved aside (``NNN.earlier-K``), never overwritten
    refused.jsonl    every request the host refused (``formats.HostRefusal``)
    workspace/       the host's workspace (``opalctl.opal.agents.workspace.FixedWorkspace``)

The three .jsonl files of the training process are appended line by line and flushed. Inside a timed update
(``with records.hold:``) lines wait in memory and are written at the next ``flush``: writing files is not part of an
update. Their lengths are part of the optimizer's ``state_dict`` so that a resumed run first cuts them back to what
the checkpoint had seen.

**Redaction.** Every line and file goes through one redaction before it reaches a file. The training process's
(``Redaction``) catches the text patterns of ``SECRET_PATTERNS`` and holds no secret and no hash of one: it runs
agent programs, which can read whatever the process holds (salted hashes of a key's 8-character pieces gave the key
back one character at a time from its known prefix). The agent host and its workers hold the keys anyway; their
``SecretRedaction`` also catches every secret they hold, whole, reversed, and in any piece of ``PIECE`` (7)
characters or more, in everything they write and everything they send back. Seven, not six: a secret-looking
variable's value is not always random (a password of words, a path in ``HF_TOKEN_PATH``), and its 6-character
pieces ("passwo", "/home/") are common in ordinary text and code, while a run of seven characters of a random key
occurs in a prompt or a transcript only by quoting it (tests/opal/test_redaction.py holds the shipped prompts and a
heuristic transcript unchanged).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import secrets as random_names
import shutil
from pathlib import Path
from typing import Any

from opalctl.files import atomic_write_json, atomic_write_text, read_plain
from opalctl.formats import (
    PROGRAM_MAX_BYTES,
    Event,
    HostDecisionRecord,
    HostRefusal,
    RecordChanged,
    RecordDamaged,
    read_bounded,
    read_record,
)
from opalctl.layout import DECISIONS, OPAL_STREAM_FILES, PROGRAMS, version_name
from opalctl.opal.handover import SECRET_NAME, secret_names
from opalctl.opal.programs import PROGRAM_FILES

__all__ = ["SECRET_PATTERNS", "SECRET_NAME", "secret_names", "PIECE", "REDACTED", "Redaction", "SecretRedaction",
           "redact_json", "OpalRecords", "HostRecords", "DecisionRecord", "line_changes", "program_sha256"]

# what a secret looks like inside text, whoever's it is
SECRET_PATTERNS = [
    re.compile(r"sk-[A-Za-z0-9_\-]{16,}"),
    re.compile(r"(?i)(api[_-]?key|token|secret|authorization|x-api-key)([\"']?\s*[:=]\s*[\"']?)([^\s\"',}]{8,})"),
    re.compile(r"(?i)bearer\s+[A-Za-z0-9._\-]{12,}"),
]
# the shortest piece of a secret the agent host's redaction catches (module docstring: why seven)
PIECE = 7
REDACTED = "[redacted]"


class Redaction:
    """The training process's redaction: the text patterns of ``SECRET_PATTERNS`` (anything shaped like an API key,
    a ``token=...`` assignment, a bearer header). It holds no secret and no hash of one (module docstring)."""

    holds_secrets = False

    def __call__(self, text: str) -> str:
        text = SECRET_PATTERNS[0].sub(REDACTED, text)
        text = SECRET_PATTERNS[1].sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
        return SECRET_PATTERNS[2].sub(f"Bearer {REDACTED}", text)


class SecretRedaction(Redaction):
    """The agent host's and its workers' redaction: the patterns, and every secret it is given (the values of the
    secret-looking variables of ``environ``, and ``secrets``) whole, reversed, and in any piece of ``PIECE``
    characters or more. Only for a process that holds the keys anyway: it holds every piece."""

    def __init__(self, secrets=(), environ=None, piece: int = PIECE):
        values = [value for value in secrets if isinstance(value, str)]
        if environ is not None:
            values += [environ[name] for name in secret_names(environ)]
        self.piece = piece
        self._pieces = frozenset(text[i:i + piece] for value in values if len(value) >= piece
                                 for text in (value, value[::-1]) for i in range(len(text) - piece + 1))

    @property
    def holds_secrets(self) -> bool:
        return bool(self._pieces)

    def __call__(self, text: str) -> str:
        if self._pieces and len(text) >= self.piece:
            text = self._cut_pieces(text)
        return super().__call__(text)

    def _cut_pieces(self, text: str) -> str:
        """``text`` with every run of characters covered by a secret's piece replaced by one ``[redacted]``."""
        pieces, size = self._pieces, self.piece
        covered_to = -1  # the end of the covered run being built (exclusive)
        runs: list[list[int]] = []
        for start in range(len(text) - size + 1):
            if text[start:start + size] in pieces:
                if runs and start <= covered_to:
                    runs[-1][1] = covered_to = start + size
                else:
                    runs.append([start, start + size])
                    covered_to = start + size
        if not runs:
            return text
        parts, at = [], 0
        for start, end in runs:
            parts += [text[at:start], REDACTED]
            at = end
        parts.append(text[at:])
        return "".join(parts)


def redact_json(value: Any, redaction) -> Any:
    """``value`` (plain JSON data) with every string in it, keys included, through ``redaction``: a redaction of the
    serialised text could cut an escape sequence in two."""
    if isinstance(value, str):
        return redaction(value)
    if isinstance(value, dict):
        return {redaction(str(key)): redact_json(item, redaction) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_json(item, redaction) for item in value]
    return value


def _json_line(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=_plain) + "\n"


def _plain(value: Any) -> Any:
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, Path):
        return str(value)
    return repr(value)


class _Hold:
    """``with records.hold:`` keeps the lines written inside it in memory (cheap enough for every update)."""

    __slots__ = ("depth",)

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc_info) -> None:
        self.depth -= 1


# the files of a decision's record (the training process's decisions/NNN/ and the agent host's, module docstring)
ANSWER, RESPONSE, MESSAGE, FACTS, TRANSCRIPT, RUNNING = ("answer.json", "response.md", "message.md", "facts.json",
                                                         "transcript.json", "running")
META = "meta.json"


class OpalRecords:
    """The training process's own records (module docstring), in ``folder`` (None: none are kept)."""

    STREAMS = tuple(OPAL_STREAM_FILES)

    def __init__(self, folder: Path | None, redaction: Redaction | None = None):
        self.folder = Path(folder) if folder is not None else None
        self.redaction = redaction or Redaction()
        self.handles: dict[str, Any] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stream in self.STREAMS:
                self.handles[stream] = open(self.folder / OPAL_STREAM_FILES[stream], "ab")
        self.hold = _Hold()  # inside it lines wait in ``_pending``; ``flush`` writes them
        self._pending: list[tuple[str, str, bool]] = []  # (stream, line, whether it is redacted when written)

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    @property
    def waiting(self) -> bool:
        """Whether lines held during an update wait to be written."""
        return bool(self._pending)

    def write(self, stream: str, value: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.write_line(stream, _json_line(value))

    def write_line(self, stream: str, line: str) -> None:
        """A line already serialised. Losses are numbers written by opalctl itself; every other line may carry
        text an agent's program or answer made (an analysis report can echo anything) and is redacted. Inside
        ``hold`` the line waits as it is: it is redacted when it is written, outside the timed update."""
        if not self.enabled:
            return
        if self.hold.depth:
            self._pending.append((stream, line, stream != "losses"))
            return
        self.flush()
        self.handles[stream].write((self.redaction(line) if stream != "losses" else line).encode())
        self.handles[stream].flush()

    def flush(self) -> None:
        """Write the lines held back inside ``hold``, in order."""
        if not self._pending or not self.enabled:
            self._pending = []
            return
        pending, self._pending = self._pending, []
        touched = set()
        for stream, line, redacted in pending:
            self.handles[stream].write((self.redaction(line) if redacted else line).encode())
            touched.add(stream)
        for stream in touched:
            self.handles[stream].flush()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """One line of ``events.jsonl``; ``kind`` must be one of ``Event.ALL`` (a programming error otherwise)."""
        if kind not in Event.ALL:
            raise ValueError(f"{kind!r} is not an event kind (opalctl.formats.Event)")
        value = {"kind": kind, **fields}
        self.write("events", value)
        return value

    def offsets(self) -> dict[str, int]:
        self.flush()
        out = {}
        for stream, handle in self.handles.items():
            handle.flush()
            os.fsync(handle.fileno())
            out[stream] = handle.tell()
        return out

    def truncate(self, offsets: dict[str, int]) -> None:
        """Cut each stream back to the length a checkpoint recorded (a resumed run redoes what came after)."""
        for stream, handle in self.handles.items():
            if stream in offsets:
                handle.flush()
                handle.truncate(int(offsets[stream]))
                handle.seek(0, os.SEEK_END)

    def save_program(self, version: int, files: dict[str, str]) -> None:
        if not self.enabled:
            return
        for name, source in files.items():
            atomic_write_text(self.folder / PROGRAMS / version_name(version) / name, self.redaction(source),
                              durable=False)

    def save_decision(self, number: int, files: dict[str, str], meta: dict[str, Any]) -> None:
        """``decisions/NNN/``: ``meta.json`` and the texts in ``files`` (none for a decision the agent host records)."""
        if not self.enabled:
            return
        folder = self.folder / DECISIONS / f"{number:03d}"
        for name, text in files.items():
            atomic_write_text(folder / name, self.redaction(text), durable=False)
        atomic_write_json(folder / META, redact_json(json.loads(json.dumps(meta, default=_plain)),
                                                            self.redaction), durable=False)

    def close(self) -> None:
        self.hold.depth = 0
        self.flush()
        for handle in self.handles.values():
            handle.close()
        self.handles = {}


# --------------------------------------------------------------------------------------------------------------
# the agent host's records

class HostRecords:
    """The agent host's records (module docstring) in ``folder``, written by the host process alone; every file
    goes through ``redaction`` (the host's ``SecretRedaction``)."""

    def __init__(self, folder: Path, redaction: Redaction):
        self.folder = Path(folder)
        self.decisions = self.folder / DECISIONS
        self.redaction = redaction
        self.decisions.mkdir(parents=True, exist_ok=True)

    def save_decision(self, record: HostDecisionRecord, *, message: str, facts: dict[str, Any],
                      running: dict[str, str], rationale: str, transcript: list, programs: dict[str, str]) -> Path:
        """Decision ``record.decision`` as the host saw it, made whole under a temporary name and then renamed into
        place (a record of the same number left by an earlier session is moved aside, never overwritten);
        returns its folder."""
        final = self.decisions / f"{record.decision:03d}"
        temporary = self.decisions / f".{final.name}.{random_names.token_hex(4)}.tmp"
        (temporary / RUNNING).mkdir(parents=True)
        try:
            texts = {MESSAGE: message, RESPONSE: rationale, **programs,
                     **{f"{RUNNING}/{name}": text for name, text in running.items()}}
            for name, text in texts.items():
                (temporary / name).write_text(self.redaction(text), encoding="utf-8")
            for name, value in ((FACTS, facts), (TRANSCRIPT, transcript), (ANSWER, record.to_json())):
                (temporary / name).write_text(json.dumps(redact_json(value, self.redaction), indent=1,
                                                         default=str), encoding="utf-8")
            if os.path.lexists(final):
                final.rename(self._aside(final))
            temporary.rename(final)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return final

    def _aside(self, final: Path) -> Path:
        taken = [int(path.name.rpartition("-")[2]) for path in self.decisions.glob(f"{final.name}.earlier-*")
                 if path.name.rpartition("-")[2].isdigit()]
        return final.with_name(f"{final.name}.earlier-{1 + max(taken, default=0)}")

    def refused(self, refusal: HostRefusal) -> None:
        """One line of ``refused.jsonl``."""
        line = json.dumps(redact_json(refusal.to_json(), self.redaction), sort_keys=True, default=str) + "\n"
        with open(self.folder / "refused.jsonl", "a", encoding="utf-8") as handle:
            handle.write(line)


def program_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def line_changes(old: str, new: str) -> dict[str, int]:
    """Lines added and removed from ``old`` to ``new`` (a short summary of a program change)."""

    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0))
    return {"added": sum(1 for x in lines if x.startswith("+") and not x.startswith("+++")),
            "removed": sum(1 for x in lines if x.startswith("-") and not x.startswith("---"))}


class DecisionRecord:
    """One decision's record as a reader (show, the report page, export, replay) finds it: the agent host's
    (``agent/decisions/NNN``, with ``answer.json``) or, in a folder without one (made before the host kept records,
    or whose backend answers in the training process), the training process's (``opal/decisions/NNN``)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    @property
    def by_host(self) -> bool:
        return (self.folder / ANSWER).is_file()

    def text(self, name: str) -> str | None:
        try:  # never a FIFO waited on, nor a device read without end (files.read_plain)
            return read_plain(self.folder / name, PROGRAM_MAX_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    @property
    def rationale(self) -> str | None:
        return self.text(RESPONSE)

    def answer(self) -> HostDecisionRecord | None:
        """``answer.json`` (None for a record the training process wrote)."""
        if not self.by_host:
            return None

        return read_record(self.folder / ANSWER, HostDecisionRecord)

    def answered(self) -> dict[str, str] | None:
        """The programs the host answered, each checked against its sha256 in ``answer.json`` (a file edited
        after the host wrote it is refused, naming it); None for a record the training process wrote."""
        answer = self.answer()
        if answer is None:
            return None
        return {name: self._checked(self.folder / name, answer.programs.get(name)) for name in PROGRAM_FILES}

    def running(self) -> dict[str, str] | None:
        """The running programs the request carried, checked as ``answered``; None for a training record."""
        answer = self.answer()
        if answer is None:
            return None
        return {name: self._checked(self.folder / RUNNING / name, answer.running.get(name)) for name in PROGRAM_FILES}

    @staticmethod
    def _checked(path: Path, sha256: str | None) -> str:
        try:
            text = read_bounded(path, PROGRAM_MAX_BYTES, "the agent host's record is damaged").decode("utf-8")
        except UnicodeDecodeError as error:
            raise RecordDamaged(f"{path} cannot be read ({error}); the agent host's record is damaged") from None
        if program_sha256(text) != sha256:
            raise RecordChanged(f"{path} is not the program the agent host answered (its sha256 differs from "
                                f"{path.parent / ANSWER}); the record was edited after the host wrote it")
        return text
