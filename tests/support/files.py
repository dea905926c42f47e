"""Reading and comparing the files tests make: records, whole folders before and after, a byte flipped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SEEDS = (1, 2)  # the seeds the built-in digits project is initialised with (tests/conftest.py)
# the start of the reason of a skip for a missing system component (a failure under OPALCTL_REQUIRE_SYSTEM=1)
SYSTEM_SKIP = "needs a system component:"


def read(path: Path) -> Any:
    """A JSON file's content."""
    return json.loads(Path(path).read_text())


def sha256_of(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int | None = None) -> int:
    """Flip every bit of one byte of ``path`` (the middle one by default); the size stays the same."""
    data = bytearray(Path(path).read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    return offset


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256), to compare a folder before and after."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): sha256_of(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def files_of(run_dir: Path) -> list[str]:
    """Every file beneath a run folder, by its name relative to it (what ``runs.FINISHED_FILES`` lists)."""
    return sorted(path.relative_to(run_dir).as_posix() for path in Path(run_dir).rglob("*") if path.is_file())


def stage_files(run_dir: Path) -> list[dict[str, Any]]:
    """A run folder's stage records, in stage order."""
    return [read(p) for p in sorted(Path(run_dir).glob("stage-*.json"))]
