"""``opalctl verify``: re-hash every record of a lock and say, file by file, what changed
(``protocol/recheck.py``); and check a run folder's chain of digests (``verify RUN_DIR``, ``verify LOCK --runs``):
read by ``folder.py``, checked by ``chain.py``'s pure functions, every finding listed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput, InputChanged, OpalctlError
from opalctl.layout import AT_UPDATE_0, NEW, START, LockRuns, RunLayout, runs_dir_default
from opalctl.protocol.lock import Lock, read_lock
from opalctl.protocol.recheck import describe, verify_lock
from opalctl.verify.chain import Finding, RunFolder, check_run, failures
from opalctl.verify.folder import is_run_folder, read_run_folder


def verify(path: str | Path) -> dict[str, Any]:
    return verify_lock(read_lock(Path(path), protocol_changes_reported=True))


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
        return None, [Finding(START, f"names lock {path}, which cannot be read here: the run is checked "
                                            f"without it", "note")]
    if lock.sha256 != start.get("lock_sha256"):
        return None, [Finding(START, f"names lock {path}, which is now another lock: the run is checked "
                                            f"without it", "note")]
    return lock, []


def verify_run(run_dir: str | Path, lock: Lock | None = None) -> dict[str, Any]:
    """Check a run folder's whole chain and every checkpoint in it; never raises for a finding, it reports it."""
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
