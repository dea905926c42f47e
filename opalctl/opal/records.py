"""The agent optimizer's own records, under ``RUN_DIR`` (the formal run puts it at ``<run>/opal/``).

    events.jsonl     one JSON object per line, its type in ``kind`` (one of ``opalctl.formats.Event``: start,
                     requested, applied, kept, load_failed, trial_passed, reverted, failed_step, wake, end, ...)
    losses.jsonl     the loss binned per analysis interval (update, mean, min, max, count, non-finite count)
    reports.jsonl    every analysis report
    programs/vNNN/   each version of updater.py and analysis.py, as loaded
    decisions/NNN/   message.md (what the agent read), response.md (its rationale), meta.json (timing, outcome)
    workspace/       where the agent edits the programs

The three .jsonl files are appended line by line and flushed. Inside a timed update (``with records.hold:``)
lines wait in memory and are written at the next ``flush``: writing files is not part of an update. Their
lengths are part of the optimizer's ``state_dict`` so that a resumed run first cuts them back to what the
checkpoint had seen. Every line and file goes through one ``Redaction`` before it reaches a file: anything shaped
like an API key or token, and any piece of eight characters or more of a secret of the environment or the
backend.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from opalctl.files import atomic_write_json, atomic_write_text
from opalctl.formats import Event

# what a secret looks like inside text, whoever's it is
SECRET_PATTERNS = [
    re.compile(r"sk-[A-Za-z0-9_\-]{16,}"),
    re.compile(r"(?i)(api[_-]?key|token|secret|authorization|x-api-key)([\"']?\s*[:=]\s*[\"']?)([^\s\"',}]{8,})"),
    re.compile(r"(?i)bearer\s+[A-Za-z0-9._\-]{12,}"),
]
# the names of environment variables that hold secrets (API keys, tokens, passwords)
SECRET_NAME = re.compile(r"(?i)(^|_)(API_?KEY|KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)($|_)|SECRET")
# the shortest piece of a secret that is caught: any longer piece holds one; a shorter one is too common to
# tell apart from ordinary text
FRAGMENT = 8
REDACTED = "[redacted]"


def secret_names(environ) -> list[str]:
    """The variables of ``environ`` whose names say they hold a secret (ANTHROPIC_API_KEY, GH_TOKEN, ...)."""
    return sorted(name for name in environ if SECRET_NAME.search(name))


class Redaction:
    """The one redaction every writer of the agent's records and of the workspace goes through.

    It catches the text patterns of ``SECRET_PATTERNS`` and, for every secret it was given (the values of the
    secret-looking variables of the environment, and the key the backend uses), the whole value and any piece of
    it of ``FRAGMENT`` characters or more. It keeps no secret: only salted hashes of each secret's pieces of
    ``FRAGMENT`` characters, so that the training process, which holds one, holds no key an agent's program could
    read back.
    """

    def __init__(self, secrets=(), environ=None):
        import secrets as random_source

        self._salt = random_source.randbits(64)
        values = [value for value in secrets if isinstance(value, str)]
        if environ is not None:
            values += [environ[name] for name in secret_names(environ)]
        self._pieces = {self._hash(value[i:i + FRAGMENT]) for value in values if len(value) >= FRAGMENT
                        for i in range(len(value) - FRAGMENT + 1)}

    def _hash(self, piece: str) -> int:
        return hash((self._salt, piece))

    @property
    def holds_secrets(self) -> bool:
        return bool(self._pieces)

    def __call__(self, text: str) -> str:
        if self._pieces and len(text) >= FRAGMENT:
            text = self._cut_pieces(text)
        text = SECRET_PATTERNS[0].sub(REDACTED, text)
        text = SECRET_PATTERNS[1].sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
        return SECRET_PATTERNS[2].sub(f"Bearer {REDACTED}", text)

    def _cut_pieces(self, text: str) -> str:
        """``text`` with every run of characters covered by a secret's piece replaced by one ``[redacted]``."""
        pieces, salt = self._pieces, self._salt
        covered_to = -1  # the end of the covered run being built (exclusive)
        runs: list[list[int]] = []
        for start in range(len(text) - FRAGMENT + 1):
            if hash((salt, text[start:start + FRAGMENT])) in pieces:
                if runs and start <= covered_to:
                    runs[-1][1] = covered_to = start + FRAGMENT
                else:
                    runs.append([start, start + FRAGMENT])
                    covered_to = start + FRAGMENT
        if not runs:
            return text
        parts, at = [], 0
        for start, end in runs:
            parts += [text[at:start], REDACTED]
            at = end
        parts.append(text[at:])
        return "".join(parts)


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


class OpalRecords:
    STREAMS = ("events", "losses", "reports")

    def __init__(self, folder: Path | None, secrets: list[str] | None = None):
        self.folder = Path(folder) if folder is not None else None
        # built before the agent host starts and this process's environment loses its secrets (see Redaction)
        self.redaction = Redaction(list(secrets or []), environ=os.environ)
        self.handles: dict[str, Any] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stream in self.STREAMS:
                self.handles[stream] = open(self.folder / f"{stream}.jsonl", "ab")
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
            atomic_write_text(self.folder / "programs" / f"v{version:03d}" / name, self.redaction(source),
                              durable=False)

    def save_decision(self, number: int, files: dict[str, str], meta: dict[str, Any]) -> None:
        if not self.enabled:
            return
        folder = self.folder / "decisions" / f"{number:03d}"
        for name, text in files.items():
            atomic_write_text(folder / name, self.redaction(text), durable=False)
        atomic_write_json(folder / "meta.json", json.loads(self.redaction(json.dumps(meta, default=_plain))),
                          durable=False)

    def close(self) -> None:
        self.hold.depth = 0
        self.flush()
        for handle in self.handles.values():
            handle.close()
        self.handles = {}
