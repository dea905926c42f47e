"""``opalctl freeze``: validate a protocol, resolve its defaults, hash every input and write the lock.

What is hashed is everything that can change a result without anyone noticing: the data files, the parents,
the protocol file itself, the task's source, every file of the opalctl package (so an edited driver or prompt
invalidates a frozen protocol) and, for agent arms, the default prompts and starting programs (they live in the
package). The environment is recorded for the reader, not verified: a different torch is worth knowing about,
not a reason to refuse.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import opalctl
from opalctl import checkpoints
from opalctl.driver.groups import check_groups
from opalctl.errors import BadInput, OpalctlError
from opalctl.files import (
    NotAPlainFile,
    atomic_write_bytes,
    atomic_write_text,
    canonical_json,
    file_record,
    read_plain,
    sha256_bytes,
    storage,
)
from opalctl.opal.agents import registry
from opalctl.protocol import provenance
from opalctl.protocol.lock import FORMAT, LOCK_MAX_BYTES, protocol_digest
from opalctl.protocol.schema import Protocol, load_protocol
from opalctl.tasks import task_source_file

PACKAGE_SUFFIXES = (".py", ".md", ".txt", ".json", ".yaml")


def package_files() -> list[Path]:
    """Every source and data file of the installed opalctl package, in a stable order."""
    root = Path(opalctl.__file__).resolve().parent
    files = []
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file() or path.suffix not in PACKAGE_SUFFIXES:
            continue
        files.append(path)
    return files


def package_role(path: Path) -> str:
    root = Path(opalctl.__file__).resolve().parent
    return f"source.opalctl/{path.relative_to(root).as_posix()}"


def _git(folder: Path) -> dict[str, Any] | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=folder,
                                capture_output=True, text=True, timeout=10)
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def environment(protocol: Protocol, folder: Path) -> dict[str, Any]:
    import numpy
    import torch

    package_root = Path(opalctl.__file__).resolve().parent
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor_count": os.cpu_count(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "distributions": provenance.distributions(),
        "cuda_available": bool(torch.cuda.is_available()),
        "opalctl": opalctl.__version__,
        "git": {"opalctl": _git(package_root), "protocol": _git(folder)},
        "threads": {
            "budget": protocol.budget.threads,
            "torch_default": torch.get_num_threads(),
            **{name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        },
    }


# agent keys added after locks were in use: an arm that does not give one resolves, and its lock hashes, as before
AGENT_KEYS_ONLY_WHEN_GIVEN = ("notes", "step_time_limit")


def resolved_protocol(protocol: Protocol) -> dict[str, Any]:
    """The protocol with every default filled in; ``parents`` becomes an explicit seed -> path mapping."""
    resolved = protocol.model_dump(mode="json")
    resolved["parents"] = {str(seed): protocol.parent_for(seed) for seed in protocol.seeds}
    for key in ("control", "target"):  # a protocol without them resolves, and its lock hashes, as it always did
        if resolved.get(key) is None:
            resolved.pop(key, None)
    for arm in resolved["arms"].values():
        if arm.get("groups") is None:  # an arm without parameter groups resolves as it always did
            arm.pop("groups", None)
        options = arm["optimizer"]
        arm["optimizer"] = {"name": options.pop("name"), **dict(sorted(options.items()))}
        if arm.get("agent"):
            for key in AGENT_KEYS_ONLY_WHEN_GIVEN:
                if arm["agent"].get(key) is None:
                    arm["agent"].pop(key, None)
            arm["agent"] = registry.lock_defaults(arm["agent"])
    return resolved


def records(protocol: Protocol, protocol_path: Path, lock_folder: Path) -> dict[str, dict]:
    folder = protocol_path.parent
    out: dict[str, dict] = {"protocol": file_record(protocol_path, lock_folder)}
    missing = []
    for split, relative in protocol.data.items():
        path = folder / relative
        if problem := input_file_problem(path):
            _refuse_unless_missing(protocol_path, f"data.{split} ({relative})", problem, "the split's file")
            missing.append(f"data.{split} ({relative})")
            continue
        out[f"data.{split}"] = file_record(path, lock_folder)
    for seed in protocol.seeds:
        relative = protocol.parent_for(seed)
        path = folder / relative
        if problem := input_file_problem(path):
            _refuse_unless_missing(protocol_path, f"parent of seed {seed} ({relative})", problem, "a checkpoint")
            missing.append(f"parent of seed {seed} ({relative})")
            continue
        out[f"parent.seed-{seed}"] = file_record(path, lock_folder)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise BadInput(f"{protocol_path}: cannot freeze, missing {shown}; paths are relative to the protocol's "
                       f"folder (for a built-in task, `opalctl init` writes them)")
    check_parents(protocol, protocol_path)
    entry_file = task_source_file(protocol.task.entry)
    out["source.task"] = source_record(entry_file, protocol.task.entry, lock_folder)
    for source in provenance.package_sources(protocol.task.entry, protocol_path):
        if source.path != entry_file:
            out[source.role] = source_record(source.path, source.module, lock_folder)
    for path in package_files():
        out[package_role(path)] = package_record(path)
    return out


def input_file_problem(path: Path) -> str | None:
    """None when ``path`` is a file freeze can read, else ``missing``, ``a folder`` or why it cannot be read."""
    try:
        if path.is_file():
            with path.open("rb"):
                return None
        return "a folder" if path.is_dir() else "missing"
    except OSError as error:
        return f"unreadable ({error.strerror or type(error).__name__})"


def _refuse_unless_missing(protocol_path: Path, what: str, problem: str, expected: str) -> None:
    """Missing inputs are listed together (a fresh folder misses them all); anything else is refused now."""
    if problem == "missing":
        return
    if problem == "a folder":
        raise BadInput(f"{protocol_path}: {what} is a folder; give the path of {expected} (paths are relative to "
                       f"the protocol's folder)")
    raise BadInput(f"{protocol_path}: {what} is {problem}; check the file and its permissions")


def check_parents(protocol: Protocol, protocol_path: Path) -> None:
    """Open each distinct parent as the run will, as a checkpoint within ``limits.checkpoint_bytes``: a file
    that is not one (torch's own weights, random bytes) or is larger is refused here, not after a budget of
    training (every stage checkpoint is about the parent's size, and each is held to the same limit)."""
    limit = protocol.limits.checkpoint_bytes
    opened: set[Path] = set()
    for seed in protocol.seeds:
        relative = protocol.parent_for(seed)
        path = (protocol_path.parent / relative).resolve()
        if path in opened:
            continue
        opened.add(path)
        size = path.stat().st_size
        if size > limit:
            raise BadInput(f"{protocol_path}: the parent of seed {seed} ({relative}) is {size} bytes, over "
                           f"limits.checkpoint_bytes ({limit}); raise that limit, since every stage checkpoint "
                           f"is about as large as the parent")
        if not zipfile.is_zipfile(path):  # what torch.save writes; torch's own message for other bytes misleads
            raise BadInput(f"{protocol_path}: the parent of seed {seed} ({relative}) is not a checkpoint (torch "
                           f"writes them as zip archives); a parent is a checkpoint written by opalctl (`opalctl "
                           f"init` writes one per seed)")
        try:
            checkpoints.load(path, limit_bytes=limit)
        except checkpoints.CheckpointRefused as error:
            raise BadInput(f"{protocol_path}: the parent of seed {seed} ({relative}) is refused: "
                           f"{error.message.rstrip('.')}; a parent is a checkpoint written by opalctl (`opalctl "
                           f"init` writes one per seed)") from None


def package_record(path: Path) -> dict[str, Any]:
    """A file of opalctl itself, located relative to the installed package (``base: opalctl``), so the lock stays
    valid when the project folder moves, and checks whichever opalctl is installed when it is verified."""
    root = Path(opalctl.__file__).resolve().parent
    record = file_record(path, root)
    record["base"] = "opalctl"
    return record


def source_record(path: Path, entry: str, lock_folder: Path) -> dict[str, Any]:
    """A task source file: relative to the lock when it lives in the project, else found again by its module name
    (``entry``: the task's entry, or the dotted name of a module of its package)."""
    root = Path(opalctl.__file__).resolve().parent
    path = path.resolve()
    if path.is_relative_to(root):
        return package_record(path)
    if path.is_relative_to(lock_folder.resolve()):
        return file_record(path, lock_folder)
    record = file_record(path, path.parent)
    record.update({"base": "module", "module": entry.partition(":")[0]})
    return record


def lock_path_for(protocol: Protocol, protocol_path: Path) -> Path:
    return protocol_path.parent / f"{protocol.name}.lock.json"


def write_lock(lock_path: Path, text: str, force: bool) -> str:
    """Write the lock unless the same one is there: ``written``, ``unchanged`` or ``replaced`` (with ``force``).

    A replaced lock is kept beside the new one as ``NAME.lock.SHA12.json`` (``kept_lock_path``): the run folders
    made from it (``runs/NAME-SHA12``) keep the lock that says what they ran, and ``opalctl verify`` or
    ``opalctl compare`` still take it."""
    outcome = "written"
    try:
        if lock_path.is_dir():
            raise BadInput(f"{lock_path} is a folder where the lock goes; move it, or rename the protocol")
        if lock_path.exists() or lock_path.is_symlink():
            try:  # the lock there, as every lock is read (never a FIFO waited on, nor a device read without end)
                previous = read_plain(lock_path, LOCK_MAX_BYTES)
            except NotAPlainFile as why:
                raise BadInput(f"{lock_path} is where the lock goes, and it cannot be read as one ({why}); move it, "
                               f"then freeze again") from None
            if previous == text.encode("utf-8"):
                return "unchanged"
            if not force:
                raise BadInput(f"lock {lock_path} already exists and differs from what freezing now would write; "
                               f"run `opalctl verify {lock_path}` to see why, or pass --force to replace it (the "
                               f"old lock is then kept as {lock_path.name.removesuffix('.json')}.SHA12.json)")
            with storage(lock_path, then="freeze again"):
                keep_replaced(lock_path, previous)
            outcome = "replaced"
        with storage(lock_path, then="freeze again"):
            atomic_write_text(lock_path, text)
    except OSError as error:
        raise OpalctlError(f"the lock {lock_path} cannot be written ({error.strerror or type(error).__name__}); "
                           f"make its folder writable or free space, then freeze again") from None
    return outcome


def kept_lock_path(lock_path: Path, previous: bytes) -> Path:
    """Where a replaced lock is kept: ``NAME.lock.SHA12.json``, named by the digest its run folders carry."""
    return lock_path.with_name(f"{lock_path.name.removesuffix('.json')}.{sha256_bytes(previous)[:12]}.json")


def keep_replaced(lock_path: Path, previous: bytes) -> Path:
    """Keep the lock about to be replaced (atomically, before the new one is written: nothing is lost either way)."""
    kept = kept_lock_path(lock_path, previous)
    try:
        same = read_plain(kept, LOCK_MAX_BYTES) == previous
    except OSError:  # missing, or not a file a lock can be read from: written over
        same = False
    if not same:
        atomic_write_bytes(kept, previous)
    return kept


def freeze(protocol_path: str | Path, *, force: bool = False) -> dict[str, Any]:
    protocol_path = Path(protocol_path)
    protocol = load_protocol(protocol_path)
    lock_path = lock_path_for(protocol, protocol_path)
    resolved = resolved_protocol(protocol)
    inputs = records(protocol, protocol_path, lock_path.parent)
    check_groups(protocol, protocol_path)  # builds a grouped arm's model: after the parents are known to open
    lock = {
        "format": FORMAT,
        "status": "frozen",
        "name": protocol.name,
        "protocol": resolved,
        "protocol_sha256": protocol_digest(resolved),
        "records": inputs,
        "environment": environment(protocol, protocol_path.parent.resolve()),
    }
    text = canonical_json(lock)
    outcome = write_lock(lock_path, text, force)
    return {
        "lock": str(lock_path),
        "sha256": sha256_bytes(text.encode("utf-8")),
        "name": protocol.name,
        "outcome": outcome,
        "records": len(lock["records"]),
        "seeds": protocol.seeds,
        "arms": list(protocol.arms),
        # the key or binary may be set before the runs start, so a warning here and a refusal at `run`
        "warnings": [f"{missing}; a run of that arm is refused until it is"
                     for missing in registry.unready_arms(protocol)],
    }
