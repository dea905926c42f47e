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
checkpoint had seen. Anything shaped like an API key or token is redacted before it reaches a file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from opalctl.files import atomic_write_json, atomic_write_text
from opalctl.formats import Event

SECRET_PATTERNS = [
    re.compile(r"sk-[A-Za-z0-9_\-]{16,}"),
    re.compile(r"(?i)(api[_-]?key|token|secret|authorization|x-api-key)([\"']?\s*[:=]\s*[\"']?)([^\s\"',}]{8,})"),
    re.compile(r"(?i)bearer\s+[A-Za-z0-9._\-]{12,}"),
]


def redact(text: str, extra: list[str] | None = None) -> str:
    for secret in extra or []:
        if secret:
            text = text.replace(secret, "[redacted]")
    text = SECRET_PATTERNS[0].sub("[redacted]", text)
    text = SECRET_PATTERNS[1].sub(lambda m: f"{m.group(1)}{m.group(2)}[redacted]", text)
    text = SECRET_PATTERNS[2].sub("Bearer [redacted]", text)
    return text


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
        self.secrets = list(secrets or [])
        self.handles: dict[str, Any] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            for stream in self.STREAMS:
                self.handles[stream] = open(self.folder / f"{stream}.jsonl", "ab")
        self.hold = _Hold()  # inside it lines wait in ``_pending``; ``flush`` writes them
        self._pending: list[tuple[str, bytes]] = []

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
        line = _json_line(value)
        # losses are numbers written by opalctl itself; everything else may carry text an agent wrote
        data = (line if stream == "losses" else redact(line, self.secrets)).encode()
        if self.hold.depth:
            self._pending.append((stream, data))
            return
        self.flush()
        handle = self.handles[stream]
        handle.write(data)
        handle.flush()

    def write_line(self, stream: str, line: str) -> None:
        """A line already serialised by opalctl (losses, reports: numbers and an analysis report, which cannot
        hold a secret since programs see no environment), written without redaction."""
        if not self.enabled:
            return
        data = line.encode()
        if self.hold.depth:
            self._pending.append((stream, data))
            return
        self.flush()
        self.handles[stream].write(data)
        self.handles[stream].flush()

    def flush(self) -> None:
        """Write the lines held back inside ``hold``, in order."""
        if not self._pending or not self.enabled:
            self._pending = []
            return
        pending, self._pending = self._pending, []
        touched = set()
        for stream, data in pending:
            self.handles[stream].write(data)
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
            atomic_write_text(self.folder / "programs" / f"v{version:03d}" / name, redact(source, self.secrets),
                              durable=False)

    def save_decision(self, number: int, files: dict[str, str], meta: dict[str, Any]) -> None:
        if not self.enabled:
            return
        folder = self.folder / "decisions" / f"{number:03d}"
        for name, text in files.items():
            atomic_write_text(folder / name, redact(text, self.secrets), durable=False)
        atomic_write_json(folder / "meta.json", json.loads(redact(json.dumps(meta, default=_plain), self.secrets)),
                          durable=False)

    def close(self) -> None:
        self.hold.depth = 0
        self.flush()
        for handle in self.handles.values():
            handle.close()
        self.handles = {}
