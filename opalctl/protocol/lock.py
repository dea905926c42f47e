"""The lock file: a protocol with every default resolved and every input it depends on hashed.

A lock is canonical JSON (sorted keys), so its sha256 is a stable identity: run folders are named after its
first 12 hex digits, and ``compare`` refuses runs of another lock. Paths inside it are relative to the lock's
own folder, so a project folder can be moved or cloned whole. ``protocol_sha256`` is the digest of the resolved
protocol as written in the lock, so a hand edit of the lock itself is caught by ``verify`` as well.

A lock is checked again where it is used, never trusted because it parses: ``validated_protocol`` runs the checks
``freeze`` runs on a protocol file (sealed data, the task, the optimizers, the backends), so a lock edited by hand
with its records and digest recomputed is refused by ``verify`` and by ``run`` as its protocol file would be.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput
from opalctl.files import canonical_json, sha256_bytes

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
            raise _refreeze(error) from None

    def validated_protocol(self):
        """The protocol checked as ``freeze`` checks a protocol file (its paths relative to the lock's folder)."""
        from opalctl.protocol.schema import ProtocolError, validate

        protocol = self.protocol()
        try:
            validate(protocol, {}, f"lock {self.path}", self.folder)
        except ProtocolError as error:
            raise _refreeze(error) from None
        return protocol

    def resolve(self, relative: str) -> Path:
        return (self.folder / relative).resolve() if not Path(relative).is_absolute() else Path(relative)

    def record_path(self, record: dict) -> Path:
        """Where a record's file is now: relative to the lock, to the installed opalctl, or to a module's folder."""
        base = record.get("base")
        if base == "opalctl":
            import opalctl

            return Path(opalctl.__file__).resolve().parent / record["path"]
        if base == "module":
            import importlib.util

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


def _refreeze(error):
    """The schema's sentence, with what to do about a lock: it is written by freeze only, never edited."""
    error.details.append("`opalctl freeze` never writes such a lock: correct the protocol file and freeze it again")
    return error


def read_lock(path: str | Path) -> Lock:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(f"lock {path} does not exist; write it with `opalctl freeze PROTOCOL.yaml`") from None
    except IsADirectoryError:
        raise BadInput(f"lock {path} is a folder; give the path of a .lock.json file") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadInput(f"lock {path} is not valid JSON ({error}); freeze the protocol again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BadInput(f"{path} is not an opalctl lock ({FORMAT}); give the file `opalctl freeze` wrote")
    if data.get("status") != "frozen":
        raise BadInput(f"lock {path} has status {data.get('status')!r}, not 'frozen'; freeze the protocol again")
    for key in ("name", "protocol", "records", "protocol_sha256", "environment"):
        if key not in data:
            raise BadInput(f"lock {path} lacks the key {key!r}; freeze the protocol again")
    # the name becomes a folder (runs/NAME-SHA12): one a hand-edited lock points elsewhere is refused here, for
    # every command that reads the lock, before any folder is made
    from opalctl.layout import plain_name

    plain_name(data["name"], "name", f"lock {path}")
    resolved = data["protocol"].get("name") if isinstance(data["protocol"], dict) else None
    if resolved != data["name"]:
        raise BadInput(f"lock {path}: its name {data['name']!r} is not its protocol's ({resolved!r}); it was edited "
                       f"by hand: freeze the protocol again")
    return Lock(path=path, data=data, sha256=sha256_bytes(raw))
