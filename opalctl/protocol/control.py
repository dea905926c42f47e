"""``opalctl control``: a control lock added after the fact, for an agent arm of a finished lock.

The question it asks: did the agent adapt to each run, or find one recipe? The agent's decisions on one seed
(``--from-seed``) are replayed as a fixed program on the lock's other seeds (the ``replay`` backend, whose decisions
fall at the same budget fractions: on the ``updates`` clock with a blocking agent, at the same updates). When the
agent's applied programs equal a fixed schedule the lock has no arm for (``opalctl.compare.controls``), that fixed
arm is added too.

A control lock is an ordinary lock, written by ``freeze`` from a protocol file beside the parent lock
(``PARENT-control-ARM-sSEED.yaml``), whose ``control`` key marks it as added after the fact (not pre-registered) and
names its parent lock's path and sha256, the arm and the run replayed. Its runs are made with the usual ``opalctl
run`` and ``grid``; ``compare PARENT`` and its report pick them up (``control_locks``) and show them in the same
tables, marked post-hoc.

The equal-compute rule (``check_control``, called wherever a lock is validated: ``verify``, ``run``, ``grid``): the
control lock's task, data, parents, budget (clock, amount, threads, stage fractions), training, limits and selection
are the parent's, and every arm has the controlled arm's ``budget_multiplier`` and ``model``; so each control run
trains on the same budget and clock as the agent arm's runs it is paired with. A control lock whose parent is
missing, or is not the lock of the named digest any more, is refused in one sentence.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from opalctl.errors import BadInput, InputChanged
from opalctl.files import atomic_write_text
from opalctl.protocol.lock import LOCK_MAX_BYTES, Lock, read_lock

SAME_AS_PARENT = ("task", "data", "budget", "training", "limits", "selection")
SAME_AS_ARM = ("budget_multiplier", "model", "groups")


def control_name(parent: str, arm: str, seed: int) -> str:
    return f"{parent}-control-{arm}-s{seed}"


def control_locks(lock: Lock) -> list[Lock]:
    """The control locks of ``lock``: beside it, named ``NAME-control-...``, naming its digest as their parent's
    (one made for an earlier lock of the same name names another digest, and is not this lock's)."""
    found = []
    for path in sorted(lock.folder.glob(f"{lock.name}-control-*.lock.json")):
        control = read_lock(path)
        link = control.resolved.get("control") or {}
        if link.get("parent_sha256") == lock.sha256:
            found.append(control)
    return found


def parent_lock(control: Lock) -> Lock:
    """The parent a control lock names, at its path or, when that lock was replaced by a later freeze, where freeze
    keeps the replaced one (``NAME.lock.SHA12.json``); refused unless its sha256 is the one named."""
    from opalctl.files import read_plain, sha256_bytes

    link = control.resolved["control"]
    named = control.resolve(link["parent_lock"])
    wanted = link["parent_sha256"]
    # where freeze keeps a lock it replaced (freeze.kept_lock_path)
    candidates = [named, named.with_name(f"{named.name.removesuffix('.json')}.{wanted[:12]}.json")]
    for path in candidates:
        try:
            raw = read_plain(path, LOCK_MAX_BYTES)
        except OSError:
            continue
        if sha256_bytes(raw) == wanted:
            return read_lock(path)
    if not named.exists():
        raise BadInput(f"control lock {control.path} names its parent lock {link['parent_lock']}, which is not there; "
                       f"a control is compared only beside the lock it controls")
    raise InputChanged(f"control lock {control.path} was made for parent lock {link['parent_lock']} with sha256 "
                       f"{wanted[:12]}, but that lock is now {_sha12(named)}; make the control again with `opalctl "
                       f"control` from the lock whose runs it controls")


def _sha12(path: Path) -> str:
    from opalctl.files import read_plain, sha256_bytes

    try:
        return sha256_bytes(read_plain(path, LOCK_MAX_BYTES))[:12]
    except OSError:
        return "unreadable"


def check_control(control: Lock, protocol) -> Lock:
    """A control lock's parent link and the equal-compute rule (module docstring); returns the parent lock."""
    parent = parent_lock(control)
    link = protocol.control
    mine, theirs = control.resolved, parent.resolved
    if link.arm not in theirs["arms"] or not theirs["arms"][link.arm].get("agent"):
        raise BadInput(f"control lock {control.path}: control.arm {link.arm!r} is no agent arm of its parent "
                       f"{parent.path}; make the control again with `opalctl control`")
    for key in SAME_AS_PARENT:
        if mine.get(key) != theirs.get(key):
            raise BadInput(f"control lock {control.path}: its {key} differs from its parent's ({parent.path}); a "
                           f"control trains under the parent's very conditions, so make it again with `opalctl "
                           f"control`")
    for seed in protocol.seeds:
        if mine["parents"].get(str(seed)) != theirs["parents"].get(str(seed)):
            raise BadInput(f"control lock {control.path}: seed {seed} is not a seed of its parent {parent.path} "
                           f"with the same parent checkpoint; make the control again with `opalctl control`")
    arm = theirs["arms"][link.arm]
    source = Path(link.source_run)
    if (source.name, source.parent.name, source.parent.parent.name) != (
            f"seed-{link.from_seed}", link.arm, f"{parent.name}-{parent.sha12}"):
        raise BadInput(f"control lock {control.path}: control.source_run {link.source_run} is not the run of arm "
                       f"{link.arm!r} on seed {link.from_seed} of its parent {parent.path}; make the control again "
                       f"with `opalctl control`")
    replay = {**arm["agent"], "backend": f"replay:{link.source_run}"}
    for name, spec in mine["arms"].items():
        if spec.get("agent") and spec["agent"] != replay:
            raise BadInput(f"control lock {control.path}: arm {name!r} is not the replay of {link.source_run} with "
                           f"the agent settings of the controlled arm {link.arm!r}; make the control again with "
                           f"`opalctl control`")
        for key in SAME_AS_ARM:
            if spec.get(key) != arm.get(key):
                raise BadInput(f"control lock {control.path}: arm {name!r} has {key} {spec.get(key)!r}, not the "
                               f"controlled arm {link.arm!r}'s {arm.get(key)!r}; a control gets the same compute "
                               f"as the arm it controls")
    return parent


def make_control(lock_path: str | Path, arm: str, *, from_seed: int | None = None, runs_dir=None,
                 force: bool = False) -> dict[str, Any]:
    """Write the control protocol beside the parent lock and freeze it; returns what was written."""
    import yaml

    from opalctl.compare.aggregate import collect
    from opalctl.compare.controls import lock_controls
    from opalctl.layout import runs_dir_default
    from opalctl.protocol.freeze import freeze

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
