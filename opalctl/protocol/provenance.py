"""Where a task came from, for the lock: the installed distributions and the sources of the task's own package.

A task rarely lives in one file: its entry module imports a model, a tokenizer, helpers from the same package, and
an edit to any of them changes what the task computes. So the lock records every ``.py`` file of the top-level
package that holds ``task.entry``'s module, each as a record ``verify`` re-hashes like any other. A task that is a
lone top-level module is recorded alone (it has no package; its folder may be anything, site-packages included).
Files under a folder or with a name that is not a Python identifier are left out: import cannot reach them, so
the task cannot run them as part of its package. A package larger than the limits below is refused: recording a
whole monorepo would make every unrelated edit a changed input.

The distributions (name and version of everything importable, as ``importlib.metadata`` lists them) are recorded
for the reader, like the rest of the environment: a different ``transformers`` is worth knowing, not a refusal.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from opalctl.errors import BadInput

MAX_PACKAGE_FILES = 1000
MAX_PACKAGE_BYTES = 32 << 20
PACKAGE_ROLE = "source.task-package/"


def distributions() -> dict[str, str]:
    """Every installed distribution's normalised name and version; where one is installed twice, the first on
    ``sys.path`` wins, as it does for import. Reading every distribution's metadata is most of a freeze's CPU time, so
    the answer is kept and read again only when a folder on ``sys.path`` has changed since (an install or an
    uninstall adds or removes its ``.dist-info`` folder there, which changes the folder's modification time)."""
    state = _path_state()
    if _read.get("state") != state:
        _read["state"], _read["found"] = state, _read_distributions()
    return dict(_read["found"])


_read: dict[str, object] = {}  # the last answer of distributions() and the state of sys.path it was read at


def _path_state() -> tuple[tuple[str, int | None], ...]:
    """Each ``sys.path`` entry with its modification time (None where it is missing or not a folder one can stat)."""
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, None))
    return tuple(state)


def _read_distributions() -> dict[str, str]:
    found: dict[str, str] = {}
    for distribution in importlib.metadata.distributions():
        name = distribution.metadata["Name"] if distribution.metadata else None
        if not name:
            continue  # a broken .dist-info without metadata names nothing
        found.setdefault(re.sub(r"[-_.]+", "-", name).lower(), distribution.version or "")
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class PackageSource:
    """One ``.py`` file of the task's package: its path and the module name import knows it by."""

    path: Path
    module: str

    @property
    def role(self) -> str:
        return PACKAGE_ROLE + self.module


def _module_name(relative: Path) -> str | None:
    """``pkg/sub/x.py`` -> ``pkg.sub.x``, ``pkg/sub/__init__.py`` -> ``pkg.sub``; None where import cannot reach."""
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if parts and all(part.isidentifier() for part in parts) else None


def package_sources(entry: str, protocol_path: Path) -> list[PackageSource]:
    """The ``.py`` files of the top-level package holding ``entry``'s module, in a stable order; empty for a lone
    module or opalctl's own tasks (opalctl's files are recorded wholesale). Refuses a package over the limits."""
    top = entry.partition(":")[0].split(".")[0]
    if top == "opalctl":
        return []
    spec = importlib.util.find_spec(top)  # the entry was imported already: the top package is importable
    if spec is None or not spec.submodule_search_locations:
        return []
    sources: list[PackageSource] = []
    seen: set[str] = set()
    total = 0
    for location in spec.submodule_search_locations:
        base = Path(location).resolve().parent
        for path in sorted(Path(location).resolve().rglob("*.py")):
            relative = path.relative_to(base)
            module = _module_name(relative)
            if module is None or module in seen or not path.is_file():
                continue
            seen.add(module)
            sources.append(PackageSource(path, module))
            total += path.stat().st_size
            if len(sources) > MAX_PACKAGE_FILES or total > MAX_PACKAGE_BYTES:
                raise BadInput(f"{protocol_path}: task.entry's package {top} ({location}) holds more than "
                               f"{MAX_PACKAGE_FILES} Python files or {MAX_PACKAGE_BYTES >> 20} MiB of them, which "
                               f"freeze records in full; give the task a package of its own")
    return sources


def added_sources(lock) -> list[dict]:
    """``.py`` files of the task's package that the lock does not record (a module added since the freeze: new code
    is a change too), as ``verify`` lists problems. The package is found from the entry module's own record, so a
    project's package needs no import path; a lone module, opalctl's tasks or a missing entry file add nothing."""
    entry_module = lock.resolved["task"]["entry"].partition(":")[0]
    parts = entry_module.split(".")
    record = lock.records.get("source.task")
    if len(parts) < 2 or parts[0] == "opalctl" or record is None:
        return []
    entry_file = lock.record_path(record)
    if not entry_file.is_file():
        return []  # reported as missing by its own record
    depth = len(parts) - 1 if entry_file.name == "__init__.py" else len(parts) - 2
    if depth >= len(entry_file.parents):
        return []  # a file that cannot be that module: its own record says whether it changed
    package = entry_file.parents[depth]
    recorded = {role for role in lock.records if role.startswith(PACKAGE_ROLE)} | {PACKAGE_ROLE + entry_module}
    added = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path.relative_to(package.parent))
        if module is not None and PACKAGE_ROLE + module not in recorded and path.is_file():
            added.append({"role": PACKAGE_ROLE + module, "path": str(path), "status": "added"})
    return added
