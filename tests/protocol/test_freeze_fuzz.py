"""Any protocol, fuzzed: freeze exits 0 or 2, says one line when it refuses, never a traceback, and each case
stays within a time and memory bound.

The cases are mutations (drawn from a fixed seed, so every run tries the same ones) of the shipped protocols and
of the shapes that once hung or crashed freeze or a later run: wrong types, huge and tiny numbers, NaN and
infinities, deep nesting, aliases and alias bombs, unicode, long strings, missing and extra keys, broken text.
Unlike ``test_fuzz.py``, whose mutations are invalid by construction, a case here may be valid: exit 0 (a lock
written, then removed) is as acceptable as exit 2. What is never acceptable is anything else.
"""

from __future__ import annotations

import copy
import random
import resource
import shutil
import time
from pathlib import Path

import pytest
import yaml

from opalctl.tasks.builtin import protocol_text
from tests.support.cli import call_cli, run_cli

REPO = Path(__file__).resolve().parents[2]
SEED = 20261201
BATCHES = 11  # of CASES_PER_BATCH cases each: 550 protocols, spread over the xdist workers
CASES_PER_BATCH = 50
# CPU seconds, which other work on the machine does not inflate: a case takes ~20 ms (the deepest text, 0.5 s)
SECONDS_PER_CASE = 5.0
GROWTH_PER_CASE = 256 << 20  # bytes the process's peak memory may grow in one case (an alias bomb took 2.2 GB)

BASES = {
    "init digits": protocol_text("digits", [1, 2]),  # the fixture's folder holds its data: it can freeze
    "protocols/digits.yaml": (REPO / "protocols" / "digits.yaml").read_text(encoding="utf-8").replace(
        "seeds: [1, 2, 3]", "seeds: [1, 2]"),
    "protocols/pylm.yaml": (REPO / "protocols" / "pylm.yaml").read_text(encoding="utf-8"),  # its data is absent
}


def nested(depth: int, leaf) -> object:
    value = leaf
    for index in range(depth):
        value = [value] if index % 2 else {"k": value}
    return value


# values a person (or an adversary) might put anywhere; no string has the `module:Class` shape, so no case
# imports a module of its own choosing (task entries are drawn from ENTRIES)
WEIRD = [
    None, True, False, 0, 1, -1, 2, 3, 64, 0.5, 1.5, -0.0, 1e-300, 1e-12, 1e300, 10**30, 2**63, 2**64 + 1,
    float("nan"), float("inf"), float("-inf"), "", " ", "x" * 5000, "a/" * 300, "数据", "é\u202eRTL", "\u0000nul",
    "1e-3", "4e1", ".5", "sealed/rows.npz", "data/../final-test/rows.npz", "/etc/passwd", "data/digits",
    "parents/digits/seed-{seed}.pt", "{seed}", [], {}, [1, 2, 3], [0.9], [0.5, 0.2], [0.2, 0.2], {"a": 1},
    {"name": "AdamW"}, nested(40, 1), nested(70, "deep"), ["x"] * 200, {f"k{i}": i for i in range(50)},
]
ENTRIES = ["opalctl.tasks.digits:Digits", "opalctl.tasks.pylm:PyLM", "opalctl.tasks.digits:Nope", "json:JSONDecoder",
           "opalctl.tasks.absent_module:Task", "os:path", "digits", ":", "x" * 300 + ":Y"]
OPTIMIZERS = ["AdamW", "SGD", "LBFGS", "SparseAdam", "Optimizer", "Adafactor", "Muon", "Rprop", "lr_scheduler",
              "nope", "ASGD"]
ARGUMENTS = {"lr": WEIRD, "betas": [[0.9, 0.999], {"a": 1}, [0.9], [True, 0.9], "x", [0.9, float("nan")]],
             "capturable": [True, 1, "yes"], "differentiable": [True], "foreach": [True, None, "x", [1]],
             "fused": [True, False], "momentum": [0.9, -1, "x"], "line_search_fn": ["strong_wolfe", 3],
             "eps": [1e-8, [None, 1e-3], -1], "weight_decay": [0.01, -5, 1e308]}
# the values that once froze and then hung or failed at run, at their keys
SHAPES = [
    (("training", "checkpoint_every"), [1e-12, 1e-3, 0.0005, 1.0, 2]),
    (("budget", "amount"), [1e-300, 0.005, 4e1, 1e9, 2.5]),
    (("budget", "clock"), ["updates", "gpu", "wall", "cpu", "sundial"]),
    (("training", "batch_size"), [10**12, 65536, 65537, 1e12, 0]),
    (("training", "device"), ["cuda", "tpu"]),
    (("limits", "checkpoint_bytes"), [1024, 2048, 10**12, 0]),
    (("seeds",), [[1, 1], [2**40], [-1], list(range(1001)), []]),
    (("budget", "fractions"), [[0.5, 0.25, 1.0], [1.0], [0.5], [0.0, 1.0], [float("nan"), 1.0]]),
]


def _paths(node, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += _paths(value, prefix + (index,))
    return out


def _parent(data, path):
    for part in path[:-1]:
        data = data[part]
    return data


def _set(data, path, value) -> None:
    node = data
    for part in path[:-1]:
        if not isinstance(node, dict):
            return
        node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            return
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node)):
        node[path[-1]] = value


def mutate_data(rng: random.Random, data: dict) -> dict:
    """One to three changes to the document as data: a value replaced, a key deleted or added, a shape."""
    data = copy.deepcopy(data)
    for _ in range(rng.randint(1, 3)):
        paths = _paths(data)
        kind = rng.random()
        path = rng.choice(paths) if paths else ("name",)
        if kind < 0.35:
            value = rng.choice(ENTRIES) if path == ("task", "entry") else rng.choice(WEIRD)
            _set(data, path, copy.deepcopy(value))
        elif kind < 0.5:
            parent = _parent(data, path)
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
        elif kind < 0.6:
            parent = _parent(data, path) if len(path) > 1 else data
            if isinstance(parent, dict):
                parent[rng.choice(["extra", "x-é", "数", "a" * 300, "checkpoint_every", "agent", "1"])] = \
                    copy.deepcopy(rng.choice(WEIRD))
        elif kind < 0.8:
            key, values = rng.choice(SHAPES)
            _set(data, key, copy.deepcopy(rng.choice(values)))
        else:
            arm = rng.choice(list(data.get("arms", {}) or {"adamw": None}))
            argument = rng.choice(list(ARGUMENTS))
            _set(data, ("arms", arm, "optimizer", "name"), rng.choice(OPTIMIZERS))
            _set(data, ("arms", arm, "optimizer", argument), copy.deepcopy(rng.choice(ARGUMENTS[argument])))
    return data


def dump(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=10**6)


def alias_bomb(rng: random.Random) -> str:
    fan_out, levels = rng.randint(2, 12), rng.randint(3, 12)
    lines = [f"b0: &b0 [{', '.join(['lol'] * fan_out)}]"]
    lines += [f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * fan_out)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def mutate_text(rng: random.Random, text: str) -> str | bytes:
    """A change to the text itself: cut, spliced, aliased, bombed, deepened, re-encoded."""
    kind = rng.randrange(9)
    lines = text.splitlines()
    if kind == 0:
        return text[: rng.randrange(len(text))]
    if kind == 1:
        at = rng.randrange(len(text))
        return text[:at] + rng.choice(["\t", ":", "- ", "{", "]", "&a ", "*a", "!!python/object:os.system ", "%",
                                       "\x00", "\ufeff", "'", "? ", "<<: "]) + text[at:]
    if kind == 2:
        return alias_bomb(rng) + text
    if kind == 3:
        return text + "deep: " + "[" * rng.choice([50, 200, 3000]) + "]" * rng.choice([0, 50, 200, 3000]) + "\n"
    if kind == 4:  # an anchor on one arm's optimizer and aliases to it from the others, as a person might
        return text.replace("{optimizer: {name: AdamW", "{optimizer: &opt {name: AdamW", 1).replace(
            "{optimizer: {name: AdamW, lr: 1.0e-3, weight_decay: 0.01}", "{optimizer: *opt")
    if kind == 5:
        index = rng.randrange(len(lines))
        lines.insert(index, lines[index])
        return "\n".join(lines) + "\n"
    if kind == 6:
        return text.encode("utf-8") + rng.choice([b"\xff\xfe", b"\x80", b"\xc3"])
    if kind == 7:
        return text + "loop: &loop [*loop]\n" if rng.random() < 0.5 else text.replace("1.0e-3", rng.choice(
            ["1e-3", "1E-3", ".001", "1e-3e", "0x10", "1_0", "0b1", "1:30", "~", "yes", "Infinity"]))
    return text + "x" + "9" * rng.choice([10, 4400, 5000]) + ": " + "9" * rng.choice([10, 5000]) + "\n"


def cases(batch: int) -> list[tuple[str, str | bytes]]:
    rng = random.Random(SEED * 100 + batch)
    out = []
    for number in range(CASES_PER_BATCH):
        base_name = rng.choice(list(BASES))
        base = BASES[base_name]
        if rng.random() < 0.65:
            content: str | bytes = dump(mutate_data(rng, yaml.safe_load(base)))
        else:
            content = mutate_text(rng, base)
        out.append((f"batch {batch} case {number} ({base_name})", content))
    return out


@pytest.fixture(scope="module")
def fuzz_project(digits_init_folder, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("freeze-fuzz") / "project"
    shutil.copytree(digits_init_folder, folder)
    return folder


def write_case(folder: Path, content: str | bytes) -> Path:
    for lock in folder.glob("*.lock.json"):
        lock.unlink()
    path = folder / "fuzzed.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    return path


def judge(label: str, content, result, seconds: float, growth: int, folder: Path) -> list[str]:
    """What is wrong with one case's outcome (nothing, for exit 0 with silence or exit 2 with one line)."""
    shown = (content if isinstance(content, str) else content.decode("utf-8", "replace"))[:300]
    problems = []
    if result.code not in (0, 2):
        problems.append(f"exit {result.code}")
    if "Traceback" in result.output or "internal error" in result.output:
        problems.append("a traceback or an internal error")
    if result.code == 2 and not (result.stdout == "" and result.stderr.startswith("opalctl: error: ")
                                 and result.stderr.count("\n") == 1 and result.stderr.endswith("\n")):
        problems.append("a refusal that is not exactly one line on stderr")
    if result.code == 0 and (result.stderr or not list(folder.glob("*.lock.json"))):
        problems.append("an exit 0 without its lock, or with something on stderr")
    if seconds > SECONDS_PER_CASE:
        problems.append(f"{seconds:.1f} s")
    if growth > GROWTH_PER_CASE:
        problems.append(f"peak memory grew {growth >> 20} MiB")
    return [f"{label}: {', '.join(problems)}\n  stdout {result.stdout[:200]!r}\n  stderr {result.stderr[:300]!r}\n"
            f"  protocol {shown!r}"] if problems else []


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


@pytest.mark.parametrize("batch", range(BATCHES))
def test_freeze_of_any_fuzzed_protocol_exits_0_or_2_with_one_line(fuzz_project, batch):
    failures, codes = [], []
    for label, content in cases(batch):
        path = write_case(fuzz_project, content)
        before, started = peak_bytes(), time.process_time()
        result = call_cli("freeze", path)
        seconds, growth = time.process_time() - started, peak_bytes() - before
        codes.append(result.code)
        failures += judge(label, content, result, seconds, growth, fuzz_project)
    assert not failures, f"{len(failures)} of {CASES_PER_BATCH} cases:\n" + "\n".join(failures[:5])
    assert codes.count(2) >= CASES_PER_BATCH // 2  # the mutations do reach the refusals


def test_the_fuzz_reaches_both_outcomes_and_every_kind_of_case(fuzz_project):
    """Guards the generator: a change that left every case valid, or every case broken YAML, would weaken the
    fuzz without failing it."""
    everything = [content for batch in range(BATCHES) for _, content in cases(batch)]
    assert len(everything) >= 500 and len({str(c) for c in everything}) >= 450
    outcomes = set()
    for content in everything[:120]:  # both outcomes among the first 120 (the batches check every case's outcome)
        outcomes.add(call_cli("freeze", write_case(fuzz_project, content)).code)
        if outcomes == {0, 2}:
            break
    assert outcomes == {0, 2}
    texts = [c for c in everything if isinstance(c, str)]
    assert any("&b0" in c for c in texts) and any("*opt" in c for c in texts)
    assert any(isinstance(c, bytes) for c in everything)


# one case of each way out: refused by the schema (0, 34), as YAML (7), by torch's optimizer (13, after torch is
# imported), and frozen (21)
SUBPROCESS_CASES = [0, 7, 13, 21, 34]


@pytest.mark.parametrize("number", SUBPROCESS_CASES)
def test_a_handful_of_fuzzed_protocols_behave_the_same_as_a_real_command(fuzz_project, number):
    """The in-process runner is what the fuzz relies on: a real ``opalctl freeze`` gives the same outcome."""
    label, content = cases(0)[number]
    path = write_case(fuzz_project, content)
    real = run_cli("freeze", path, cwd=fuzz_project)
    assert not judge(label, content, real, 0.0, 0, fuzz_project)
    path = write_case(fuzz_project, content)
    inprocess = call_cli("freeze", path)
    assert (real.code, real.stderr) == (inprocess.code, inprocess.stderr)

