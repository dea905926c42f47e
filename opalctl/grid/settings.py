"""The Slurm executor's settings: from flags or a small YAML file, never from the frozen protocol.

Where a run trains (partition, account, extra ``sbatch`` options) says nothing about the comparison, so it is kept
out of the lock: the same lock runs on a laptop and on any cluster. A flag wins over the file. The file::

    partition: cpu
    account: my-lab
    time_limit_minutes: 90        # else: the pilot's projection times the margin (grid/slurm.py)
    time_margin: 2.0
    max_requeues: 3               # how often a job that timed out or was preempted is requeued
    sbatch: {qos: normal, mem: 4G}   # any other sbatch option, as submitit's additional parameters
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from opalctl.errors import BadInput

MAX_FILE_BYTES = 64 * 1024


@dataclass
class SlurmSettings:
    partition: str | None = None
    account: str | None = None
    time_limit_minutes: int | None = None
    time_margin: float = 2.0
    max_requeues: int = 3
    sbatch: dict[str, Any] = field(default_factory=dict)

    def check(self, where: str) -> SlurmSettings:
        if self.time_limit_minutes is not None and (not isinstance(self.time_limit_minutes, int)
                                                    or self.time_limit_minutes < 1):
            raise BadInput(f"time_limit_minutes in {where} must be a whole number of minutes, at least 1")
        if not isinstance(self.time_margin, (int, float)) or self.time_margin < 1:
            raise BadInput(f"time_margin in {where} must be a number of at least 1 (the projection times it)")
        if not isinstance(self.max_requeues, int) or self.max_requeues < 0:
            raise BadInput(f"max_requeues in {where} must be a whole number, at least 0")
        if not isinstance(self.sbatch, dict) or not all(isinstance(k, str) for k in self.sbatch):
            raise BadInput(f"sbatch in {where} must be a mapping of sbatch option names to values")
        return self


def load_settings(path: str | Path | None = None, **flags: Any) -> SlurmSettings:
    """The file's settings (if any), then each flag that was given (not None) over them."""
    values: dict[str, Any] = {}
    where = "the flags"
    if path is not None:
        values = _read(Path(path))
        where = str(path)
    given = {key: value for key, value in flags.items() if value not in (None, (), [], {})}
    if "sbatch" in given:
        given["sbatch"] = {**values.get("sbatch", {}), **given["sbatch"]}
    return SlurmSettings(**{**values, **given}).check(where)


def _read(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise BadInput(f"Slurm settings file {path} is larger than {MAX_FILE_BYTES // 1024} KiB; keep it short")
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"Slurm settings file {path} does not exist; give the path of a YAML file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise BadInput(f"Slurm settings file {path} cannot be read as YAML ({type(error).__name__}); "
                       f"fix it or give the settings as flags") from None
    data = data or {}
    if not isinstance(data, dict):
        raise BadInput(f"Slurm settings file {path} must hold a mapping (partition: ..., account: ...)")
    known = {f.name for f in fields(SlurmSettings)}
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise BadInput(f"Slurm settings file {path} has the unknown key {unknown[0]!r}; the keys are "
                       f"{', '.join(sorted(known))}")
    return data


def parse_sbatch_options(options: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``--sbatch KEY=VALUE`` flags as a mapping."""
    parsed = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.strip():
            raise BadInput(f"--sbatch {option!r} must be KEY=VALUE, e.g. --sbatch qos=normal")
        parsed[key.strip().lstrip("-")] = value
    return parsed
