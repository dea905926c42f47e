"""A run folder read for the chain (``chain.py``): every record the chain names, every checkpoint hashed and, for
``verify``, opened with ``checkpoints.load`` within the lock's limit, the steps file decoded. This is the only part
of the chain that touches files; ``show``, ``compare``, ``report`` and ``export`` read a folder here without
opening its checkpoints (their files' sha256 only) and refuse its first finding in one sentence
(``checked_run_folder``).
"""

from __future__ import annotations

import os
from pathlib import Path

from opalctl import checkpoints
from opalctl.driver.records import read_steps
from opalctl.files import NotAPlainFile, plain_sha256, read_plain, sha256_bytes
from opalctl.formats import (
    PROGRAM_MAX_BYTES,
    RECORD_MAX_BYTES,
    REPORT_MAX_BYTES,
    Event,
    HostDecisionRecord,
    RecordChanged,
    RecordDamaged,
    decode_record,
    read_jsonl,
    read_record,
)
from opalctl.layout import PROGRAMS, RunLayout
from opalctl.opal.records import ANSWER, PROGRAM_FILES, program_sha256
from opalctl.verify.chain import (
    CHANGED,
    DAMAGED,
    AgentRecords,
    CheckpointRead,
    Finding,
    RecordRead,
    RunFolder,
    StepsRead,
    check_run,
    failures,
)


def _record(folder: Path, name: str, limit: int = RECORD_MAX_BYTES) -> RecordRead:
    try:
        data = read_plain(folder / name, limit)
    except FileNotFoundError:
        return RecordRead(name, None)
    except NotAPlainFile as why:
        return RecordRead(name, "", error=f"cannot be read ({why})")
    except OSError as error:
        return RecordRead(name, "", error=f"cannot be read ({error.strerror or error})")
    value, why = decode_record(data)
    return RecordRead(name, sha256_bytes(data), value=value, error=why)


def _checkpoint(folder: Path, name: str, load: bool, limit_bytes: int) -> CheckpointRead:
    path = folder / name
    try:
        found = CheckpointRead(name, plain_sha256(path), loaded=load)
    except FileNotFoundError:
        return CheckpointRead(name, None)
    except OSError as error:
        return CheckpointRead(name, "", error=f"cannot be read ({error})", loaded=False)
    if load:
        try:
            found.model_sha256 = checkpoints.load(path, limit_bytes=limit_bytes, require_finite=False)["model_sha256"]
        except checkpoints.CheckpointRefused as error:
            found.error = error.message.removeprefix(f"checkpoint {path}").lstrip(" :")
    return found


def _steps(layout: RunLayout) -> StepsRead:
    path = layout.steps
    name = layout.name_of(path)
    try:
        found = StepsRead(plain_sha256(path), name)
    except FileNotFoundError:
        return StepsRead(None, name)
    except OSError as error:
        return StepsRead("", name, error=f"cannot be read ({error})")
    try:
        for line in read_steps(path):
            found.lines += 1
            found.numbered = found.numbered and line.get("update") == found.lines
            found.last_update, found.last_seen = line.get("update"), line.get("seen")
    except (ValueError, RecursionError):  # a line that is not UTF-8 or not JSON inside a gzip member that reads
        found.error = f"holds a line that is not JSON after line {found.lines}"
    except OSError as error:  # replaced by another kind of file since it was hashed
        found.error = f"cannot be read ({error})"
    if found.error is None and found.lines == 0 and path.stat().st_size > 0:
        found.error = "holds no complete gzip member (it is not gzip, or was cut short)"
    return found


def _agent_records(layout: RunLayout) -> AgentRecords | None:
    """An agent arm's decisions as the agent host recorded them and as the training process did (the chain's
    ``AgentRecords``); None for a folder without the host's records (no agent, a backend that answers in the
    training process, a folder made before the host kept them)."""
    events = layout.events
    if not layout.host_decisions.is_dir() or not os.path.lexists(events):  # a FIFO there is read, and refused
        return None
    records = AgentRecords(answered={}, outcomes={}, loaded={}, events=layout.name_of(events),
                           programs=layout.name_of(layout.opal / PROGRAMS))
    for number in layout.decision_numbers():
        path = layout.decision_folder(number) / ANSWER
        try:
            answer = read_record(path, HostDecisionRecord)
        except RecordDamaged as error:
            records.unreadable.append(Finding(layout.name_of(path), error.message.split("; ")[0].removeprefix(
                f"{path} "), DAMAGED))
            continue
        records.answered[number] = None if answer.failed else dict(answer.programs)
    try:
        for event in read_jsonl(events):
            if event.get("kind") in Event.OUTCOMES and isinstance(event.get("decision"), int):
                version = event.get("version")
                records.outcomes[event["decision"]] = (event["kind"], version if isinstance(version, int) else None)
    except RecordDamaged as error:
        records.unreadable.append(Finding(records.events, error.message.split("; ")[0].removeprefix(f"{events} "),
                                          DAMAGED))
    for kind, version in records.outcomes.values():
        if kind == Event.APPLIED and version is not None:
            folder = layout.program_version(version)
            records.loaded[version] = {name: _text_sha256(folder / name, program_sha256) for name in PROGRAM_FILES}
    return records


def _text_sha256(path: Path, digest) -> str | None:
    try:
        return digest(read_plain(path, PROGRAM_MAX_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def read_run_folder(run_dir: str | Path, *, load_checkpoints: bool, limit_bytes: int | None = None) -> RunFolder:
    """Every record of a run folder that the chain names, as it is on the disk (``chain.check_run`` checks it)."""
    layout = RunLayout.of(run_dir)
    folder = layout.root
    limit = limit_bytes or checkpoints.DEFAULT_LIMIT_BYTES
    # Read in the reverse of the order a run writes (the close: last.json, selected.json, report.json, then the
    # resume checkpoint removed; before it the stages, the start, the anchor): a folder written while it is read
    # then reads as a state it was in, never as a run that closed without its report
    resumable = layout.resume.exists()
    report = _record(folder, layout.name_of(layout.report), REPORT_MAX_BYTES)
    selected = _record(folder, layout.name_of(layout.selected))
    last = _record(folder, layout.name_of(layout.last))
    stages = [_record(folder, path.name) for path in layout.stage_records()]
    found = RunFolder(start=_record(folder, layout.name_of(layout.start)), stages=stages, last=last,
                      selected=selected, report=report,
                      anchor=_record(folder, layout.name_of(layout.anchor.record)), steps=_steps(layout),
                      resumable=resumable, agent=_agent_records(layout))
    for path in layout.stage_records():
        number = int(path.stem.removeprefix("stage-"))
        found.stage_checkpoints[path.name] = layout.name_of(layout.stage_checkpoint(number))
    for name in [layout.name_of(layout.initial), *found.stage_checkpoints.values()]:
        found.checkpoints[name] = _checkpoint(folder, name, load_checkpoints, limit)
    return found


def is_run_folder(path: Path) -> bool:
    """A folder opalctl ran in (opalctl/layout.py)."""
    return RunLayout.of(path).is_run_folder()


def refuse_damaged(run_dir: Path, findings: list[Finding]) -> None:
    """Raise the first failing finding as one sentence naming its file: exit 3 for a record that no longer
    matches (``RecordChanged``), 1 for one that cannot be read (``RecordDamaged``)."""
    problems = failures(findings)
    if not problems:
        return
    first = problems[0]
    path = os.path.normpath(Path(run_dir) / first.file)
    more = f" and {len(problems) - 1} more finding(s)" if len(problems) > 1 else ""
    sentence = (f"{path} {first.problem}{more}; the run's records are not what opalctl wrote, so nothing is shown "
                f"(`opalctl verify {run_dir}` lists every finding)")
    raise (RecordChanged if first.kind == CHANGED else RecordDamaged)(sentence)


def checked_run_folder(run_dir: str | Path) -> RunFolder:
    """A run folder read for ``show`` and ``compare`` (checkpoints hashed, not opened), refused when its chain
    has any finding."""
    folder = read_run_folder(run_dir, load_checkpoints=False)
    # a finished run's verdict rests on its anchor record; an unfinished folder copied alone may be shown without
    refuse_damaged(Path(run_dir), check_run(folder, anchor_required=folder.report.sha256 is not None))
    return folder
