"""The lock's re-check: every record it names re-hashed (``verify LOCK``, and ``run`` and ``pilot`` before any work),
and its protocol validated again as ``freeze`` validates a protocol file.

Like ``dvc status``: each record is ``ok``, ``changed`` (same size, other bytes), ``resized`` or ``missing``.
The formal run calls the same function before it trains anything, so a run can never start on inputs that are
not the ones that were frozen.

When every record matches, the lock's protocol is validated as ``freeze`` validates a protocol file
(``validated_protocol``): matching records prove only that the lock agrees with itself, and a lock edited by
hand (a split pointed at sealed data, its record and digest recomputed) agrees with itself too. Such a lock is
bad input (exit 2, the sentence ``freeze`` would give naming the lock and the key), not a changed input (exit 3):
no file can be restored to fix it, only a new freeze of a valid protocol. A changed record is reported first,
because restoring it may be the whole fix (a task module that is importable again).

It lies beside the lock's reader (``lock.py``), above what it calls: the schema, ``freeze``'s parent check and the
control rule, each of which reads locks itself.
"""

from __future__ import annotations

import os
from typing import Any

from opalctl.errors import InputChanged
from opalctl.files import sha256_file
from opalctl.protocol.control import check_control
from opalctl.protocol.freeze import check_parents, package_files, package_role
from opalctl.protocol.lock import Lock, refreeze
from opalctl.protocol.provenance import added_sources
from opalctl.protocol.schema import ProtocolError, validate


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
    recorded = {role for role in lock.records if role.startswith("source.opalctl/")}
    out = []
    for path in package_files():
        role = package_role(path)
        if role not in recorded:
            out.append({"role": role, "path": str(path), "status": "added"})
    return out


def validated_protocol(lock: Lock):
    """The protocol checked as ``freeze`` checks a protocol file (its paths relative to the lock's folder, each
    parent opened as a checkpoint within the limit)."""
    protocol = lock.protocol()
    try:
        validate(protocol, {}, f"lock {lock.path}", lock.folder)
    except ProtocolError as error:
        raise refreeze(error) from None
    check_parents(protocol, lock.path)  # its sentences name the lock: "LOCK: the parent of seed 1 ..."
    if protocol.control is not None:  # a control lock (opalctl control): its parent, and equal compute
        check_control(lock, protocol)
    return protocol


def verify_lock(lock: Lock, roles: list[str] | None = None) -> dict[str, Any]:
    """Check every record (or only ``roles``); never raises for a difference, it reports it. With no difference,
    raises ``ProtocolError`` (exit 2) when the lock's protocol is one ``freeze`` refuses."""
    results = [check_record(lock, role, record) for role, record in sorted(lock.records.items())
               if roles is None or role in roles]
    problems = [r for r in results if r["status"] != "ok"]
    if roles is None:
        # a protocol edited by hand is a change, named first; what it names of the task is not looked at then
        problems += added_package_files(lock) + (added_sources(lock) if lock.digest_matches else [])
    if roles is None and not lock.digest_matches:
        problems.insert(0, {"role": "lock.protocol", "path": lock.path.name, "status": "changed"})
    if not problems:
        validated_protocol(lock)
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
