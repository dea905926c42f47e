"""``opalctl verify``: re-hash every record of a lock and say, file by file, what changed; and check a run
folder's chain of digests (``verify RUN_DIR``, ``verify LOCK --runs``).

Like ``dvc status``: each record is ``ok``, ``changed`` (same size, other bytes), ``resized`` or ``missing``.
The formal run calls the same function before it trains anything, so a run can never start on inputs that are
not the ones that were frozen.

When every record matches, the lock's protocol is validated as ``freeze`` validates a protocol file
(``Lock.validated_protocol``): matching records prove only that the lock agrees with itself, and a lock edited by
hand (a split pointed at sealed data, its record and digest recomputed) agrees with itself too. Such a lock is
bad input (exit 2, the sentence ``freeze`` would give naming the lock and the key), not a changed input (exit 3):
no file can be restored to fix it, only a new freeze of a valid protocol. A changed record is reported first,
because restoring it may be the whole fix (a task module that is importable again).

A run folder is read here (``read_run_folder``: every record the chain names, every checkpoint opened with
``checkpoints.load`` within the lock's limit, the steps file decoded) and checked by driver/chain.py's pure
functions; ``show`` and ``compare`` read it the same way without opening the checkpoints (their files' sha256
only), and refuse the first finding in one sentence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from opalctl.driver.chain import (
    CHANGED,
    DAMAGED,
    AgentRecords,
    CheckpointFile,
    Finding,
    RecordFile,
    RunFolder,
    StepsFile,
    failures,
)
from opalctl.errors import BadInput, InputChanged, OpalctlError
from opalctl.files import NotAPlainFile, plain_sha256, read_plain, sha256_bytes, sha256_file
from opalctl.formats import (
    PROGRAM_MAX_BYTES,
    RECORD_MAX_BYTES,
    REPORT_MAX_BYTES,
    RecordChanged,
    RecordDamaged,
    decode_record,
)
from opalctl.layout import AT_UPDATE_0, NEW, LockRuns, RunLayout, runs_dir_default
from opalctl.protocol.lock import Lock, read_lock


def check_record(lock: Lock, role: str, record: dict) -> dict[str, Any]:
    path = lock.record_path(record)
    shown = record["path"] if not record.get("base") else str(path)
    entry = {"role": role, "path": shown, "expected_bytes": record["bytes"],
             "expected_sha256": record["sha256"]}
    if not path.is_file():
        return {**entry, "status": "missing"}
    size = os.path.getsize(path)
    if size != record["bytes"]:
        return {**entry, "status": "resized", "bytes": size}
    digest = sha256_file(path)
    if digest != record["sha256"]:
        return {**entry, "status": "changed", "bytes": size, "sha256": digest}
    return {**entry, "status": "ok"}


def added_package_files(lock: Lock) -> list[dict[str, Any]]:
    """Files of the installed opalctl package that the lock does not record: new code is a change too."""
    from opalctl.protocol.freeze import package_files, package_role

    recorded = {role for role in lock.records if role.startswith("source.opalctl/")}
    out = []
    for path in package_files():
        role = package_role(path)
        if role not in recorded:
            out.append({"role": role, "path": str(path), "status": "added"})
    return out


def verify_lock(lock: Lock, roles: list[str] | None = None) -> dict[str, Any]:
    """Check every record (or only ``roles``); never raises for a difference, it reports it. With no difference,
    raises ``ProtocolError`` (exit 2) when the lock's protocol is one ``freeze`` refuses."""
    results = [check_record(lock, role, record) for role, record in sorted(lock.records.items())
               if roles is None or role in roles]
    problems = [r for r in results if r["status"] != "ok"]
    if roles is None:
        from opalctl.protocol.provenance import added_sources

        # a protocol edited by hand is a change, named first; what it names of the task is not looked at then
        problems += added_package_files(lock) + (added_sources(lock) if lock.digest_matches else [])
    if roles is None and not lock.digest_matches:
        problems.insert(0, {"role": "lock.protocol", "path": lock.path.name, "status": "changed"})
    if not problems:
        lock.validated_protocol()
    return {
        "lock": str(lock.path),
        "sha256": lock.sha256,
        "name": lock.name,
        "ok": not problems,
        "checked": len(results),
        "problems": problems,
        "records": results,
    }


def describe(problems: list[dict]) -> str:
    return "; ".join(f"{p['role']} {p['path']} {p['status']}" for p in problems)


def require_unchanged(lock: Lock, roles: list[str] | None = None) -> dict[str, Any]:
    """Raise InputChanged (exit 3) naming every changed file, or ProtocolError (exit 2) for a lock whose protocol
    ``freeze`` refuses; used by ``run`` and ``pilot`` before any work."""
    report = verify_lock(lock, roles)
    if not report["ok"]:
        count = len(report["problems"])
        raise InputChanged(f"{count} frozen input{'s' if count > 1 else ''} no longer match{'es' if count == 1 else ''} "
                           f"lock {lock.path}: {describe(report['problems'])}; restore them or freeze again")
    return report


def verify(path: str | Path) -> dict[str, Any]:
    return verify_lock(read_lock(Path(path), protocol_changes_reported=True))


# --------------------------------------------------------------------------------------------------------------
# run folders

def _record(folder: Path, name: str, limit: int = RECORD_MAX_BYTES) -> RecordFile:
    try:
        data = read_plain(folder / name, limit)
    except FileNotFoundError:
        return RecordFile(name, None)
    except NotAPlainFile as why:
        return RecordFile(name, "", error=f"cannot be read ({why})")
    except OSError as error:
        return RecordFile(name, "", error=f"cannot be read ({error.strerror or error})")
    value, why = decode_record(data)
    return RecordFile(name, sha256_bytes(data), value=value, error=why)


def _checkpoint(folder: Path, name: str, load: bool, limit_bytes: int) -> CheckpointFile:
    from opalctl import checkpoints

    path = folder / name
    try:
        found = CheckpointFile(name, plain_sha256(path), loaded=load)
    except FileNotFoundError:
        return CheckpointFile(name, None)
    except OSError as error:
        return CheckpointFile(name, "", error=f"cannot be read ({error})", loaded=False)
    if load:
        try:
            found.model_sha256 = checkpoints.load(path, limit_bytes=limit_bytes, require_finite=False)["model_sha256"]
        except checkpoints.CheckpointRefused as error:
            found.error = error.message.removeprefix(f"checkpoint {path}").lstrip(" :")
    return found


def _steps(layout: RunLayout) -> StepsFile:
    from opalctl.driver.records import read_steps

    path = layout.steps
    name = layout.name_of(path)
    try:
        found = StepsFile(plain_sha256(path), name)
    except FileNotFoundError:
        return StepsFile(None, name)
    except OSError as error:
        return StepsFile("", name, error=f"cannot be read ({error})")
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
    """An agent arm's decisions as the agent host recorded them and as the training process did (chain.py's
    ``AgentRecords``); None for a folder without the host's records (no agent, a backend that answers in the
    training process, a folder made before the host kept them)."""
    from opalctl.formats import Event, HostDecisionRecord, read_jsonl, read_record
    from opalctl.opal.records import ANSWER, PROGRAM_FILES, program_sha256

    events = layout.opal / "events.jsonl"
    if not layout.host_decisions.is_dir() or not os.path.lexists(events):  # a FIFO there is read, and refused
        return None
    records = AgentRecords(answered={}, outcomes={}, loaded={}, events=layout.name_of(events),
                           programs=layout.name_of(layout.opal / "programs"))
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
            folder = layout.opal / "programs" / f"v{version:03d}"
            records.loaded[version] = {name: _text_sha256(folder / name, program_sha256) for name in PROGRAM_FILES}
    return records


def _text_sha256(path: Path, digest) -> str | None:
    try:
        return digest(read_plain(path, PROGRAM_MAX_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def read_run_folder(run_dir: str | Path, *, load_checkpoints: bool, limit_bytes: int | None = None) -> RunFolder:
    """Every record of a run folder that the chain names, as it is on the disk (driver/chain.py checks it)."""
    from opalctl import checkpoints

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


def _lock_of_run(folder: RunFolder, given: Lock | None) -> tuple[Lock | None, list[Finding]]:
    """The lock the run's start record names (or the one given) and a note when it cannot be used."""
    if given is not None:
        return given, []
    start = folder.start.value if isinstance(folder.start.value, dict) else {}
    path = start.get("lock")
    if not isinstance(path, str):
        return None, []
    try:
        lock = read_lock(Path(path))
    except OpalctlError:
        return None, [Finding("start.json", f"names lock {path}, which cannot be read here: the run is checked "
                                            f"without it", "note")]
    if lock.sha256 != start.get("lock_sha256"):
        return None, [Finding("start.json", f"names lock {path}, which is now another lock: the run is checked "
                                            f"without it", "note")]
    return lock, []


def verify_run(run_dir: str | Path, lock: Lock | None = None) -> dict[str, Any]:
    """Check a run folder's whole chain and every checkpoint in it; never raises for a finding, it reports it."""
    from opalctl.driver.chain import check_run

    folder = Path(run_dir)
    if not folder.is_dir() or not is_run_folder(folder):
        raise BadInput(f"{folder} is not a run folder (it has no start.json); give runs/<name>-<sha>/<arm>/seed-<S> "
                       f"or a lock file")
    quick = read_run_folder(folder, load_checkpoints=False)
    lock_used, notes = _lock_of_run(quick, lock)
    limit = lock_used.protocol().limits.checkpoint_bytes if lock_used is not None else None
    findings = notes + check_run(read_run_folder(folder, load_checkpoints=True, limit_bytes=limit),
                                 lock.sha256 if lock is not None else None)
    problems = failures(findings)
    return {"run_dir": str(folder), "ok": not problems, "lock": str(lock_used.path) if lock_used else None,
            "findings": [finding.to_json() for finding in problems],
            "notes": [finding.to_json() for finding in findings if finding not in problems]}


def verify_runs(lock_path: str | Path, runs_dir=None) -> dict[str, Any]:
    """The lock (as ``verify``), then every run folder of it under the runs folder."""
    lock = read_lock(Path(lock_path), protocol_changes_reported=True)
    runs_of = LockRuns.of(runs_dir_default(runs_dir), lock)
    layouts = sorted((layout for arm in lock.resolved["arms"] for layout in runs_of.seeds_of(arm)),
                     key=lambda layout: layout.root)
    runs, not_started = [], []
    for layout in layouts:
        waiting = not_yet_training(layout)
        if waiting is None:
            runs.append(verify_run(layout.root, lock))
        else:
            not_started.append({"run_dir": str(layout.root), "state": waiting})
    checked = verify_lock(lock)
    notes = [{"file": entry["run_dir"], "problem": f"{entry['state']}: it has not trained yet, so there is nothing "
                                                  f"to verify"} for entry in not_started]
    return {**checked, "ok": checked["ok"] and all(run["ok"] for run in runs), "runs_base": str(runs_of.base),
            "runs": runs, "not_started": not_started, "notes": notes}


def not_yet_training(layout: RunLayout) -> str | None:
    """``running, not yet started`` for a folder a live process holds that has no record of training yet (just
    made by a grid, or at update 0), ``not started`` for one nothing holds that holds no record of a run (a start
    refused before its first record), else None: a run folder to verify."""
    state = layout.state
    if layout.held() and state in (NEW, AT_UPDATE_0):
        return "running, not yet started"
    return None if layout.is_run_folder() else "not started"


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
    from opalctl.driver.chain import check_run

    folder = read_run_folder(run_dir, load_checkpoints=False)
    # a finished run's verdict rests on its anchor record; an unfinished folder copied alone may be shown without
    refuse_damaged(Path(run_dir), check_run(folder, anchor_required=folder.report.sha256 is not None))
    return folder


def verify_target(target: str | Path, *, runs: bool = False, runs_dir=None) -> dict[str, Any]:
    """``opalctl verify TARGET``: a run folder (``kind`` "run"), a lock (``kind`` "lock"), or with ``runs`` a lock
    and every run folder of it (``kind`` "runs")."""
    path = Path(target)
    if path.is_dir():
        if runs or runs_dir is not None:
            raise BadInput(f"--runs and --runs-dir go with a lock file, and {path} is a folder; give the lock")
        return {"kind": "run", **verify_run(path)}
    if runs:
        return {"kind": "runs", **verify_runs(path, runs_dir)}
    if runs_dir is not None:
        raise BadInput("--runs-dir goes with --runs; add --runs to check the lock's run folders")
    return {"kind": "lock", **verify(path)}


def run_failure(result: dict[str, Any]) -> InputChanged:
    """The refusal of a run folder (or a lock's run folders) that does not verify: one sentence, and one line per
    finding under it."""
    runs = [result] if result["kind"] == "run" else [run for run in result["runs"] if not run["ok"]]
    details = [f"{os.path.normpath(os.path.join(run['run_dir'], finding['file']))}: {finding['problem']}"
               for run in runs for finding in run["findings"]]
    if result["kind"] == "runs" and result["problems"]:
        details = [f"{result['lock']}: {describe(result['problems'])}"] + details
    where = f"run {result['run_dir']}" if result["kind"] == "run" else f"the runs of lock {result['lock']}"
    count = len(details)
    return InputChanged(f"{where} do{'es' if result['kind'] == 'run' else ''} not verify ({count} finding"
                        f"{'s' if count != 1 else ''}); restore the files named from a copy you trust, or run the "
                        f"arm again in another --runs-dir", details=details)
