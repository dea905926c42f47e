"""``opalctl control``: write the control protocol of an agent arm of a finished lock beside it and freeze it
(what a control lock is, and the rule it is held to: ``control.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from opalctl.compare.aggregate import collect
from opalctl.compare.controls import lock_controls
from opalctl.errors import BadInput
from opalctl.files import atomic_write_text
from opalctl.layout import runs_dir_default
from opalctl.protocol.control import SAME_AS_PARENT, control_name
from opalctl.protocol.freeze import freeze
from opalctl.protocol.lock import read_lock


def make_control(lock_path: str | Path, arm: str, *, from_seed: int | None = None, runs_dir=None,
                 force: bool = False) -> dict[str, Any]:
    """Write the control protocol beside the parent lock and freeze it; returns what was written."""
    lock = read_lock(Path(lock_path))
    arms = lock.resolved["arms"]
    if arm not in arms:
        raise BadInput(f"--arm {arm!r} is not an arm of {lock.path} ({', '.join(arms)})")
    if not arms[arm].get("agent"):
        raise BadInput(f"--arm {arm!r} of {lock.path} has no agent: a control replays an agent arm's decisions")
    if lock.resolved.get("control"):
        raise BadInput(f"{lock.path} is itself a control lock; make controls of the pre-registered lock")
    runs_dir = runs_dir_default(runs_dir)
    base, finished, _ = collect(lock, runs_dir)
    done = sorted(finished.get(arm, {}))
    if not done:
        raise BadInput(f"arm {arm!r} of {lock.path} has no finished run under {base}; run it first")
    seed = done[0] if from_seed is None else from_seed
    if seed not in done:
        raise BadInput(f"--from-seed {seed}: arm {arm!r} has no finished run on that seed (finished: "
                       f"{', '.join(map(str, done))})")
    others = [s for s in lock.resolved["seeds"] if s != seed]
    if not others:
        raise BadInput(f"{lock.path} has one seed only: a replay on the other seeds needs at least two")
    source = (base / arm / f"seed-{seed}").resolve()
    replay = {**arms[arm], "agent": {**arms[arm]["agent"], "backend": f"replay:{source}"}}
    new_arms = {f"{arm}-replay-s{seed}": replay}
    controls = lock_controls(lock, base, {arm: finished[arm]}).get(arm) or {}
    missing = controls.get("missing_arm")
    if missing:
        name = missing["name"] if missing["name"] not in arms else f"{missing['name']}-control"
        new_arms[name] = {k: v for k, v in missing["arm"].items() if k != "agent"}
    name = control_name(lock.name, arm, seed)
    protocol = {key: lock.resolved[key] for key in (*SAME_AS_PARENT,)}
    protocol.update(name=name, parents={int(s): lock.resolved["parents"][str(s)] for s in others}, seeds=others,
                    arms=new_arms,
                    control={"post_hoc": True, "parent_lock": os.path.relpath(lock.path, lock.folder),
                             "parent_sha256": lock.sha256, "arm": arm, "from_seed": seed,
                             "source_run": str(source)})
    path = lock.folder / f"{name}.yaml"
    text = (f"# A control added after the fact (post-hoc, not pre-registered), written by `opalctl control` for\n"
            f"# arm {arm} of {lock.path.name} (sha256 {lock.sha12}): its decisions on seed {seed} replayed on seeds\n"
            f"# {', '.join(map(str, others))}" + (", and the fixed arm its programs equal" if missing else "")
            + ". Edit nothing: verify refuses a control that differs from its parent.\n"
            + yaml.safe_dump(_plain(protocol), sort_keys=False))
    if path.exists() and path.read_text(encoding="utf-8") != text and not force:
        raise BadInput(f"{path} exists and differs from the control this would write; remove it or pass --force")
    atomic_write_text(path, text)
    frozen = freeze(path, force=force)
    return {**frozen, "protocol": str(path), "parent": str(lock.path), "parent_sha256": lock.sha256,
            "from_seed": seed, "replayed_on": others, "fixed_arm": bool(missing),
            "next": f"opalctl grid {frozen['lock']}"}


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
