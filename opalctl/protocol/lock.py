"""The lock file: a protocol with every default resolved and every input it depends on hashed.

A lock is canonical JSON (sorted keys), so its sha256 is a stable identity: run folders are named after its
first 12 hex digits, and ``compare`` refuses runs of another lock. Paths inside it are relative to the lock's
own folder, so a project folder can be moved or cloned whole. ``protocol_sha256`` is the digest of the resolved
protocol as written in the lock, so a hand edit of the lock itself is caught by ``verify`` as well.

A lock is checked again where it is used, never trusted because it parses. ``read_lock``, the one reader of a lock
(every command that takes one: verify, run, grid, compare, report, export, the evaluator), reads it as every file
opalctl did not just write is read (``files.read_plain``: a regular file within ``LOCK_MAX_BYTES``, never a FIFO
waited on or a device read without end; JSON nested at most ``files.MAX_JSON_DEPTH`` deep), then holds it to what
``freeze`` writes, before any folder is made:

- its shape (``lock_shape_problem``): every key of the right type, every record a path, a size and a sha256;
- its names (``layout.name_problem``): the lock's and every arm's can be a folder of the runs folder, and the lock's
  is its protocol's;
- its protocol, parsed by the schema's own strict rules (``Lock.protocol``);
- its records tied to that protocol (``check_records``): each split's and each parent's record names the very path
  the protocol names (a lock whose ``data.selection`` was pointed at the training rows, its digest recomputed,
  would otherwise verify its own record while a run read the other file), and every limit holds against the
  parent (``limits.checkpoint_bytes`` is at least the parent's size, as freeze checked).

What needs the files (sealed data where the paths lead, the task, the optimizers, the backends, each parent a
checkpoint that loads within the limit) is ``recheck.validated_protocol``, which ``verify`` and ``run`` call once the
records match. So a lock edited by hand either verifies and is safe to run, or is refused (exit 2 naming the key, or exit 3
for an edit ``verify`` sees as a change: a protocol that no longer matches ``protocol_sha256``).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import opalctl
from opalctl.errors import BadInput
from opalctl.files import JSONRefused, NotAPlainFile, canonical_json, decode_json, read_plain, sha256_bytes
from opalctl.layout import plain_name

FORMAT = "opalctl-lock/1"


def protocol_digest(resolved: dict) -> str:
    return sha256_bytes(canonical_json(resolved).encode("utf-8"))


@dataclass
class Lock:
    path: Path
    data: dict[str, Any]
    sha256: str

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def sha12(self) -> str:
        return self.sha256[:12]

    @property
    def records(self) -> dict[str, dict]:
        return self.data["records"]

    @property
    def resolved(self) -> dict:
        return self.data["protocol"]

    def protocol(self):
        """The resolved protocol as a ``Protocol``, parsed by the schema's own strict rules; a value the schema
        refuses is a ``ProtocolError`` naming this lock and the key (exit 2), never a traceback."""
        from opalctl.protocol.schema import ProtocolError, parse

        try:
            return parse(_seed_keys(self.resolved), {}, f"lock {self.path}")
        except ProtocolError as error:
            raise refreeze(error) from None

    @property
    def digest_matches(self) -> bool:
        """Whether the protocol is the one ``protocol_sha256`` vouches for (else it was edited: ``verify`` says so)."""
        return protocol_digest(self.resolved) == self.data["protocol_sha256"]

    def resolve(self, relative: str) -> Path:
        return (self.folder / relative).resolve() if not Path(relative).is_absolute() else Path(relative)

    def record_path(self, record: dict) -> Path:
        """Where a record's file is now: relative to the lock, to the installed opalctl, or to a module's folder."""
        base = record.get("base")
        if base == "opalctl":
            return Path(opalctl.__file__).resolve().parent / record["path"]
        if base == "module":
            try:
                spec = importlib.util.find_spec(record["module"])
            except (ImportError, ValueError):
                spec = None
            if spec is None or not spec.origin:
                return Path(f"<module {record['module']} not importable>")
            return Path(spec.origin).resolve()
        return self.resolve(record["path"])

    def data_path(self, split: str) -> Path:
        return self.resolve(self.resolved["data"][split])

    def parent_path(self, seed: int) -> Path:
        return self.resolve(self.resolved["parents"][str(seed)])


def _seed_keys(resolved: dict) -> dict:
    """The protocol as a protocol file gives it: JSON made the seeds of ``parents`` strings, the schema wants ints."""
    parents = resolved.get("parents")
    if isinstance(parents, dict):
        parents = {int(key) if isinstance(key, str) and key.isdigit() else key: value
                   for key, value in parents.items()}
        return {**resolved, "parents": parents}
    return resolved


REFREEZE = "`opalctl freeze` never writes such a lock: correct the protocol file and freeze it again"


def refreeze(error):
    """The schema's sentence, with what to do about a lock (it is written by freeze only, never edited): one line."""
    error.message = f"{error.message}; {REFREEZE}"
    error.args = (error.message,)
    return error


LOCK_MAX_BYTES = 16 << 20  # a lock records every file of opalctl and the task: some 100 kB
TOP_KEYS = {"format": str, "status": str, "name": str, "protocol": dict, "protocol_sha256": str, "records": dict,
            "environment": dict}
RECORD_KEYS = {"path": str, "bytes": int, "sha256": str, "base": str, "module": str}
SHA256 = re.compile(r"[0-9a-f]{64}")
MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def read_lock(path: str | Path, *, protocol_changes_reported: bool = False) -> Lock:
    """The lock at ``path``, read and checked as the module docstring says; every refusal is one sentence naming the
    lock and the key (exit 2). With ``protocol_changes_reported`` (``verify``, which lists a protocol that no longer
    matches ``protocol_sha256`` as a change, exit 3), such a protocol is not parsed here."""
    path = Path(path)
    try:
        raw = read_plain(path, LOCK_MAX_BYTES)
    except FileNotFoundError:
        raise BadInput(f"lock {path} does not exist; write it with `opalctl freeze PROTOCOL.yaml`") from None
    except NotAPlainFile as why:
        if path.is_dir():
            raise BadInput(f"lock {path} is a folder; give the path of a .lock.json file") from None
        raise BadInput(f"lock {path} cannot be read ({why}); give the .lock.json file `opalctl freeze` wrote") \
            from None
    except OSError as error:
        raise BadInput(f"lock {path} cannot be read ({error.strerror or error}); give the .lock.json file `opalctl "
                       f"freeze` wrote") from None
    try:
        data = decode_json(raw, finite=True)  # what canonical_json wrote, so protocol_digest can digest it
    except JSONRefused as why:
        raise BadInput(f"lock {path} is not valid JSON (it {why}); freeze the protocol again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BadInput(f"{path} is not an opalctl lock ({FORMAT}); give the file `opalctl freeze` wrote")
    if data.get("status") != "frozen":
        raise BadInput(f"lock {path} has status {data.get('status')!r}, not 'frozen'; freeze the protocol again")
    for key in ("name", "protocol", "records", "protocol_sha256", "environment"):
        if key not in data:
            raise BadInput(f"lock {path} lacks the key {key!r}; freeze the protocol again")
    if problem := lock_shape_problem(data):
        key, text = problem
        raise BadInput(f"lock {path}: {key}: {text}; it was edited by hand: freeze the protocol again")
    # the names become folders (runs/NAME-SHA12/ARM): one a hand-edited lock points elsewhere is refused here, for
    # every command that reads the lock, before any folder is made
    plain_name(data["name"], "name", f"lock {path}")
    resolved = data["protocol"].get("name")
    if resolved != data["name"]:
        raise BadInput(f"lock {path}: its name {data['name']!r} is not its protocol's ({resolved!r}); it was edited "
                       f"by hand: freeze the protocol again")
    for arm in data["protocol"]["arms"]:
        plain_name(arm, "arm", f"lock {path}: arms")
    lock = Lock(path=path, data=data, sha256=sha256_bytes(raw))
    if not (protocol_changes_reported and not lock.digest_matches):
        check_records(lock, lock.protocol())
    return lock


def lock_shape_problem(data: dict) -> tuple[str, str] | None:
    """``(key, what is wrong)`` for the first key of a lock (its top level, its records, the protocol's arms) that
    is not of the shape ``freeze`` writes, else None. The protocol's other keys are the schema's (``Lock.protocol``)."""
    from opalctl.protocol.schema import path_problem

    for key, kind in TOP_KEYS.items():
        if not isinstance(data.get(key), kind):
            return key, f"is {_kind(data.get(key))}, where freeze writes {_kind_name(kind)}"
    extra = sorted(set(data) - set(TOP_KEYS))
    if extra:
        return str(extra[0]), "is no key of a lock"
    if not SHA256.fullmatch(data["protocol_sha256"]):
        return "protocol_sha256", "is not a sha256 (64 lowercase hex digits)"
    for role, record in data["records"].items():
        if not isinstance(record, dict):
            return f"records.{role}", f"is {_kind(record)}, where freeze writes an object"
        for key, kind in RECORD_KEYS.items():
            present = key in record
            if key in ("path", "bytes", "sha256") and not present:
                return f"records.{role}", f"lacks {key!r}"
            if present and (not isinstance(record[key], kind) or isinstance(record[key], bool)):
                return f"records.{role}.{key}", f"is {_kind(record[key])}, where freeze writes {_kind_name(kind)}"
        extra = sorted(set(record) - set(RECORD_KEYS))
        if extra:
            return f"records.{role}.{extra[0]}", "is no key of a record"
        if reason := path_problem(record["path"]):
            return f"records.{role}.path", reason.partition(";")[0]
        if Path(record["path"]).is_absolute():
            return f"records.{role}.path", "is absolute, where freeze writes a path relative to the lock's folder"
        if record["bytes"] < 0:
            return f"records.{role}.bytes", "is negative"
        if not SHA256.fullmatch(record["sha256"]):
            return f"records.{role}.sha256", "is not a sha256 (64 lowercase hex digits)"
        base = record.get("base")
        if base not in (None, "opalctl", "module"):
            return f"records.{role}.base", "is neither 'opalctl' nor 'module'"
        if (base == "module") != ("module" in record) or (base == "module" and not MODULE.fullmatch(record["module"])):
            return f"records.{role}.module", "names a module only with base 'module', and then a dotted module name"
        if base == "opalctl" and not _beneath(record["path"]):
            return f"records.{role}.path", "leaves the opalctl package"
    arms = data["protocol"].get("arms")
    if not isinstance(arms, dict) or not arms:
        return "protocol.arms", f"is {_kind(arms)}, where freeze writes an object naming each arm"
    return None


def _beneath(relative: str) -> bool:
    parts = Path(relative).parts
    return bool(parts) and not Path(relative).is_absolute() and ".." not in parts


def _kind(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"{'an object' if isinstance(value, dict) else 'a list'} of {len(value)}"
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _kind_name(kind: type) -> str:
    return {str: "a string", int: "an integer", dict: "an object"}[kind]


def recorded_path(folder: Path, relative: str) -> str:
    """The path a lock's record gives a file the protocol names ``relative`` (``files.file_record``: relative to the
    lock's folder, which is the protocol's)."""
    return os.path.relpath(os.path.abspath(Path(folder) / relative), os.path.abspath(folder))


def check_records(lock: Lock, protocol) -> None:
    """The lock's records tied to its protocol as ``freeze`` made them: one record of each split and each seed's
    parent, at the path the protocol names and no other, the protocol file's beside the lock, the task's source;
    and ``limits.checkpoint_bytes`` no smaller than any parent (every stage checkpoint is about the parent's size, so
    a smaller limit refuses the first stage after a quarter of the budget). A refusal is a ``ProtocolError`` naming
    the lock and the key (exit 2)."""
    from opalctl.protocol.schema import ProtocolError

    problems: list[tuple[str, int | None, str]] = []
    records = lock.records
    named = {f"data.{split}": (f"data.{split}", relative) for split, relative in protocol.data.items()}
    for seed in protocol.seeds:
        if isinstance(protocol.parents, dict) and seed not in protocol.parents:
            problems.append(("parents", None, f"no parent for seed {seed}, which freeze requires"))
        else:
            named[f"parent.seed-{seed}"] = ("parents", protocol.parent_for(seed))
    for role, (key, relative) in named.items():
        record = records.get(role)
        if record is None:
            problems.append((key, None, f"the lock holds no record {role} of {relative!r}, which freeze records"))
        elif record.get("base") or record["path"] != recorded_path(lock.folder, relative):
            problems.append((key, None, f"names {relative!r}, but the lock's record {role} is of "
                                        f"{record['path']!r}: a record vouches only for the file the protocol names"))
    for role in sorted(records):
        if role.startswith(("data.", "parent.")) and role not in named:
            problems.append((f"records.{role}", None, "records a file the protocol does not name"))
    protocol_record = records.get("protocol")
    if protocol_record is None or protocol_record.get("base") or not _is_plain_file_name(protocol_record["path"]):
        problems.append(("records.protocol", None, "is not the record of a protocol file beside the lock"))
    if "source.task" not in records:
        problems.append(("records.source.task", None, "is missing: freeze records the task's source"))
    limit = protocol.limits.checkpoint_bytes
    for seed in protocol.seeds:
        record = records.get(f"parent.seed-{seed}")
        if record is not None and f"parent.seed-{seed}" in named and record["bytes"] > limit:
            problems.append(("limits.checkpoint_bytes", None,
                             f"is {limit}, below the parent of seed {seed} ({protocol.parent_for(seed)}, "
                             f"{record['bytes']} bytes); every stage checkpoint is about as large as the parent, so "
                             f"raise the limit"))
            break
    if problems:
        raise refreeze(ProtocolError(f"lock {lock.path}", problems))


def _is_plain_file_name(relative: str) -> bool:
    return relative not in ("", ".", "..") and "/" not in relative and "\\" not in relative
