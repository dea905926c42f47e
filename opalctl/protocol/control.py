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

from pathlib import Path

from opalctl.errors import BadInput, InputChanged
from opalctl.files import read_plain, sha256_bytes
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
