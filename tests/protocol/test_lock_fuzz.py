"""Any lock, edited by hand: ``verify`` and ``run`` exit 0, 2 or 3, say one line on stderr when they refuse, never a
traceback, and each case stays within a time and memory bound.

The cases (drawn from a fixed seed, so every run tries the same ones) are a frozen digits lock with one to three
changes to it as JSON, in the style of ``test_freeze_fuzz.py``: any key of its top level, of a record or of its
protocol given a value of another type or shape, a huge or tiny number, a long or odd string, a name that leaves
the runs folder, a path of another file; keys deleted and added; arms renamed; a split or a parent re-pointed;
``limits.checkpoint_bytes`` shrunk. Most cases then recompute ``protocol_sha256``, as a forger would, so that the
lock agrees with itself and the edit reaches the checks behind the digest. The lock is valid JSON in every case
(broken text is ``test_a_bad_lock_is_bad_input``'s). ``run`` is given ``--resume`` on a fresh runs folder: a lock it
accepts ends in "there is no run to resume" (exit 2) after every check of the lock, never in training.
"""

from __future__ import annotations

import copy
import json
import random
import resource
import shutil
import time
from pathlib import Path

import pytest

from opalctl.files import canonical_json
from opalctl.protocol.lock import protocol_digest
from tests.support.cli import call_cli

SEED = 20261203
CASES = 120
SECONDS_PER_CASE = 5.0  # CPU seconds, for verify and run together (a lock that verifies hashes ~130 files twice)
GROWTH_PER_CASE = 256 << 20


def nested(depth: int, leaf) -> object:
    value = leaf
    for index in range(depth):
        value = [value] if index % 2 else {"k": value}
    return value


WEIRD = [
    None, True, False, 0, 1, -1, 2, 1023, 1024, 2**63, 10**400, 0.5, -0.0, 1e-300, 1e308, "", " ", "x" * 5000,
    "a/" * 300, "数据", "é\u202eRTL", "\u0000nul", "../../elsewhere", "/etc/passwd", "/dev/zero", "report.html",
    "anchors", "5", "1e3", "nan", "true", "data/digits/train.npz", "parents/digits/seed-2.pt", "sealed/x.npz",
    "0" * 64, "F" * 64, "opalctl-lock/1", "frozen", [], {}, [1, 2, 3], {"a": 1}, {"path": "x"}, nested(40, 1),
    nested(70, "deep"), ["x"] * 200, {f"k{i}": i for i in range(50)},
]
NAMES = ["../../x", "/tmp/x", "..", ".hidden", "report.html", "anchors", "5", "1e3", "nan", "true", "a b", "x" * 65,
         "digits", "adamw", "ok-name", "数"]


def _paths(node, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, prefix + (index,))
    return out


def _at(data, path):
    for part in path:
        data = data[part]
    return data


def mutate(rng: random.Random, lock: dict) -> tuple[dict, bool]:
    """One to three changes to the lock; whether the protocol's digest is to be recomputed."""
    lock = copy.deepcopy(lock)
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        protocol = lock.get("protocol") if isinstance(lock.get("protocol"), dict) else None
        records = lock.get("records") if isinstance(lock.get("records"), dict) else None
        if kind < 0.12:  # a top-level key
            key = rng.choice(sorted(lock) + ["extra"])
            if rng.random() < 0.3:
                lock.pop(key, None)
            else:
                lock[key] = copy.deepcopy(rng.choice(WEIRD))
        elif kind < 0.35 and records:  # a record
            role = rng.choice(sorted(records))
            choice = rng.random()
            if choice < 0.15 or not isinstance(records[role], dict):
                records[role] = copy.deepcopy(rng.choice(WEIRD))
            elif choice < 0.3:
                records.pop(role)
            elif choice < 0.4:
                records[rng.choice(["data.extra", "parent.seed-9", "source.x"])] = copy.deepcopy(records[role])
            else:
                field = rng.choice(["path", "bytes", "sha256", "base", "module", "extra"])
                if rng.random() < 0.2:
                    records[role].pop(field, None)
                else:
                    records[role][field] = copy.deepcopy(rng.choice(WEIRD))
        elif kind < 0.7 and protocol is not None:  # a key of the protocol
            path = rng.choice(_paths(protocol))
            parent = _at(protocol, path[:-1])
            choice = rng.random()
            if choice < 0.2 and isinstance(parent, dict):
                parent.pop(path[-1])
            elif choice < 0.3 and isinstance(parent, dict):
                parent[rng.choice(["extra", "1", "数"])] = copy.deepcopy(rng.choice(WEIRD))
            else:
                parent[path[-1]] = copy.deepcopy(rng.choice(WEIRD))
        elif kind < 0.8 and protocol is not None and isinstance(protocol.get("arms"), dict) and protocol["arms"]:
            arm = rng.choice(sorted(protocol["arms"]))
            protocol["arms"][rng.choice(NAMES)] = protocol["arms"].pop(arm)
        elif kind < 0.87:  # the lock's name, and perhaps its protocol's with it
            name = rng.choice(NAMES)
            lock["name"] = name
            if protocol is not None and rng.random() < 0.7:
                protocol["name"] = name
        elif kind < 0.95 and protocol is not None:  # a split or a parent re-pointed, a limit shrunk
            target = rng.choice(["data", "parents", "limits"])
            if target == "data" and isinstance(protocol.get("data"), dict) and protocol["data"]:
                split = rng.choice(sorted(protocol["data"]))
                protocol["data"][split] = rng.choice(["data/digits/train.npz", "data/digits/selection.npz",
                                                      "../digits.yaml", "parents/digits/seed-1.pt"])
            elif target == "parents" and isinstance(protocol.get("parents"), dict) and protocol["parents"]:
                seed = rng.choice(sorted(protocol["parents"]))
                protocol["parents"][seed] = rng.choice(["parents/digits/seed-2.pt", "data/digits/train.npz"])
            elif isinstance(protocol.get("limits"), dict):
                protocol["limits"]["checkpoint_bytes"] = rng.choice([1024, 4096, 100_000, 10**12])
        else:
            lock["protocol_sha256"] = rng.choice(["0" * 64, "not a digest", 5])
    return lock, rng.random() < 0.8


def write_case(path: Path, lock: dict, recompute: bool) -> None:
    if recompute and isinstance(lock.get("protocol"), dict):
        lock["protocol_sha256"] = protocol_digest(lock["protocol"])
    path.write_text(canonical_json(lock), encoding="utf-8")


@pytest.fixture(scope="module")
def frozen(digits_init_folder, tmp_path_factory) -> tuple[Path, dict]:
    from opalctl.protocol.freeze import freeze

    folder = tmp_path_factory.mktemp("lock-fuzz") / "project"
    shutil.copytree(digits_init_folder, folder)
    lock = Path(freeze(folder / "digits.yaml")["lock"])
    return lock, json.loads(lock.read_text(encoding="utf-8"))


def judge(label: str, command: str, result, seconds: float, growth: int) -> list[str]:
    problems = []
    if result.code not in (0, 2, 3):
        problems.append(f"exit {result.code}")
    if "Traceback" in result.output or "internal error" in result.output:
        problems.append("a traceback or an internal error")
    if result.code != 0 and result.stderr.count("\n") != 1:
        problems.append("a refusal that is not exactly one line on stderr")
    if result.code == 2 and not result.stderr.startswith("opalctl: error: "):
        problems.append("a refusal that is not an error")
    if result.code == 0 and result.stderr:
        problems.append("an exit 0 with something on stderr")
    if seconds > SECONDS_PER_CASE:
        problems.append(f"{seconds:.1f} s")
    if growth > GROWTH_PER_CASE:
        problems.append(f"peak memory grew {growth >> 20} MiB")
    return [f"{label} {command}: {', '.join(problems)}\n  stdout {result.stdout[:200]!r}\n  stderr "
            f"{result.stderr[:400]!r}"] if problems else []


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_verify_and_run_of_any_hand_edited_lock_exit_0_2_or_3_with_one_line(frozen, tmp_path):
    lock_path, original = frozen
    rng = random.Random(SEED)
    failures, codes = [], {"verify": [], "run": []}
    for number in range(CASES):
        lock, recompute = mutate(rng, original)
        write_case(lock_path, lock, recompute)
        runs = tmp_path / f"runs-{number}"
        for command, args in (("verify", ("verify", lock_path)),
                              ("run", ("run", lock_path, "--arm", "adamw", "--seed", "1", "--resume",
                                       "--runs-dir", runs))):
            before, started = peak_bytes(), time.process_time()
            result = call_cli(*args)
            seconds, growth = time.process_time() - started, peak_bytes() - before
            codes[command].append(result.code)
            failures += judge(f"case {number}", command, result, seconds, growth)
            if failures and len(failures) > 5:
                break
        assert not list(tmp_path.glob(f"runs-{number}/**/*.json")), f"case {number}: run wrote a record"
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:5])
    # the mutations reach the refusals of the lock (2), the changes verify names (3), and locks that still verify
    print({command: {code: found.count(code) for code in set(found)} for command, found in codes.items()})
    assert {0, 2, 3} <= set(codes["verify"]), codes["verify"]
    assert codes["verify"].count(2) >= CASES // 3


def test_the_unedited_lock_verifies_and_run_refuses_only_for_want_of_a_run_to_resume(frozen, tmp_path):
    """Guards the fuzz: its base lock is one every command accepts."""
    lock_path, original = frozen
    write_case(lock_path, copy.deepcopy(original), recompute=False)
    assert call_cli("verify", lock_path).code == 0
    result = call_cli("run", lock_path, "--arm", "adamw", "--seed", "1", "--resume", "--runs-dir",
                           tmp_path / "runs")
    assert result.code == 2 and "there is no run to resume" in result.stderr, result.output
