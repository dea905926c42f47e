"""The suite lock, ``NAME.suite.lock.json`` in the suite's folder: the suite file's digest, the suite as written,
and each task's lock by path and sha256 (canonical JSON, so its own sha256 is the suite's identity).

Read back (``read_suite_lock``) it is held to its shape, and every task lock it names must still be the file it
names (the same sha256): a task lock frozen again, or edited, since the suite was frozen is a changed input (exit
3) naming the file. Each task lock is then read by ``protocol.lock.read_lock``, as every lock is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput, InputChanged
from opalctl.files import JSONRefused, NotAPlainFile, decode_json, read_plain, sha256_bytes, sha256_file

FORMAT = "opalctl-suite-lock/1"
MAX_BYTES = 4 << 20
SUFFIX = ".suite.lock.json"


def suite_lock_path(folder: Path, name: str) -> Path:
    return folder / f"{name}{SUFFIX}"


@dataclass
class SuiteLock:
    path: Path
    data: dict[str, Any]
    sha256: str

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def baseline(self) -> str:
        return self.data["baseline"]

    @property
    def tasks(self) -> list[str]:
        return list(self.data["tasks"])

    def lock_of(self, task: str) -> Path:
        """The task's lock, as a path (relative to the suite lock's folder when written so)."""
        return (self.path.parent / self.data["tasks"][task]["lock"]).resolve()


def read_suite_lock(path: Path) -> SuiteLock:
    advice = "freeze the suite again (`opalctl suite freeze SUITE.yaml`)"
    try:
        raw = read_plain(path, MAX_BYTES)
    except FileNotFoundError:
        raise BadInput(f"there is no suite lock at {path}; {advice}") from None
    except (NotAPlainFile, OSError) as error:
        raise BadInput(f"the suite lock {path} cannot be read ({error}); {advice}") from None
    try:
        data = decode_json(raw)
    except (JSONRefused, ValueError, UnicodeDecodeError):
        raise BadInput(f"the suite lock {path} is not JSON; {advice}") from None
    if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("tasks"), dict)
            and data["tasks"] and isinstance(data.get("name"), str) and isinstance(data.get("baseline"), str)
            and all(isinstance(entry, dict) and isinstance(entry.get("lock"), str)
                    and isinstance(entry.get("sha256"), str) for entry in data["tasks"].values())):
        raise BadInput(f"{path} is not a suite lock of this opalctl ({FORMAT}); {advice}")
    lock = SuiteLock(path, data, sha256_bytes(raw))
    for task, entry in data["tasks"].items():
        task_lock = lock.lock_of(task)
        try:
            digest = sha256_file(task_lock)
        except OSError:
            raise InputChanged(f"the lock of task {task} ({task_lock}), named by suite lock {path}, is missing; "
                               f"restore it or {advice}") from None
        if digest != entry["sha256"]:
            raise InputChanged(f"the lock of task {task} ({task_lock}) is not the one suite lock {path} names (it was "
                               f"frozen again or edited); restore it or {advice}")
    return lock


def check_suite_file(lock: SuiteLock, suite_path: Path) -> None:
    """The suite file a command was given must be the one the lock was frozen from (exit 3 otherwise)."""
    recorded = lock.data.get("suite_file", {}).get("sha256")
    if recorded != sha256_file(suite_path):
        raise InputChanged(f"{suite_path} changed since it was frozen into {lock.path}; freeze it again with "
                           f"`opalctl suite freeze {suite_path} --force` (the old task locks are kept)")
