"""Invalid protocols, fuzzed: each one is refused with exit 2 and one sentence on stderr, never a traceback.

Every case is a mutation of the valid digits protocol that is invalid *by construction*: a value of a type the
schema cannot accept at that key (a non-finite number where a number is expected, an optimizer argument torch
refuses), an unknown key in a mapping that forbids them, a required key deleted, or YAML text broken so that it
cannot be parsed (or repeats a key). A mutation that could stay valid (deleting a key that has a default, an
``int`` where a ``float`` is allowed) is never generated, so an exit 0 here is a real failure of validation.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opalctl.tasks.builtin import protocol_text
from tests.support.cli import call_cli

BASE_TEXT = protocol_text("digits", [1, 2])
BASE = yaml.safe_load(BASE_TEXT)
ARMS = list(BASE["arms"])
LIST_RULES = [rule for rule, value in BASE["selection"].items() if isinstance(value, list)]


def dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) and out else (f".{part}" if out else str(part))
    return out


# --------------------------------------------------------------------------------------------------------------
# what each key of the digits protocol accepts, and values it certainly does not

KINDS: dict[tuple, str] = {
    ("name",): "name",
    ("task",): "mapping",
    ("task", "entry"): "entry",
    ("task", "config"): "mapping",
    ("task", "config", "hidden"): "int",  # a task's config is as strict as the rest: "12" and 12.0 are refused
    ("task", "config", "replay_share"): "float",
    ("data",): "mapping",
    **{("data", split): "str" for split in BASE["data"]},
    ("parents",): "parents",
    ("seeds",): "list",
    **{("seeds", index): "int" for index in range(len(BASE["seeds"]))},
    ("budget",): "mapping",
    ("budget", "clock"): "clock",
    ("budget", "amount"): "float",
    ("budget", "threads"): "int",
    ("budget", "fractions"): "list",
    **{("budget", "fractions", index): "float" for index in range(len(BASE["budget"]["fractions"]))},
    ("training",): "mapping",
    ("training", "batch_size"): "int",
    ("training", "gradient_clip"): "optional_float",  # null is allowed there: never give None
    ("arms",): "mapping",
    ("selection",): "mapping",
    ("selection", "floors"): "mapping",
    **{("selection", "floors", metric): "float" for metric in BASE["selection"]["floors"]},
    **{("selection", rule): "list" for rule in LIST_RULES},
    **{("selection", rule, index): "str" for rule in LIST_RULES for index in range(len(BASE["selection"][rule]))},
}
for _arm in ARMS:
    KINDS[("arms", _arm)] = "mapping"
    KINDS[("arms", _arm, "optimizer")] = "mapping"
    KINDS[("arms", _arm, "optimizer", "name")] = "optimizer_name"
    if "schedule" in BASE["arms"][_arm]:
        KINDS[("arms", _arm, "schedule")] = "schedule"
    if "budget_multiplier" in BASE["arms"][_arm]:
        KINDS[("arms", _arm, "budget_multiplier")] = "float"
    for _argument in BASE["arms"][_arm]["optimizer"]:
        if _argument != "name":  # lr, weight_decay: torch refuses a negative one, a string, a list...
            KINDS[("arms", _arm, "optimizer", _argument)] = "optimizer_number"

PRINTABLE = st.characters(exclude_categories=("Cs", "Cc", "Zl", "Zp"))
texts = st.text(PRINTABLE, max_size=8)
words = st.from_regex(r"[a-z]{1,6}", fullmatch=True).filter(lambda s: s not in ("inf", "nan"))
ints = st.integers(-(10**6), 10**6)
finite = st.floats(allow_nan=False, allow_infinity=False)
nonfinite = st.sampled_from([float("inf"), float("-inf"), float("nan")])
negative = st.one_of(st.integers(max_value=-1), st.floats(max_value=-1e-6, allow_infinity=False))
bools = st.booleans()
none = st.none()
lists = st.lists(st.integers(0, 9), max_size=3)
dicts = st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), min_size=1, max_size=2)

NOT_STR = st.one_of(ints, finite, bools, none, lists, dicts)
NOT_FLOAT = st.one_of(texts, bools, lists, dicts, nonfinite)  # an int is a valid float, so none is given

WRONG = {
    "str": NOT_STR,
    "name": st.one_of(NOT_STR, st.sampled_from(["", "-digits", "has space", "a/b", "x" * 65])),
    "entry": st.one_of(NOT_STR, st.sampled_from(["digits", "opalctl.tasks.digits", ":Digits", "opalctl tasks:Digits",
                                                 "opalctl.tasks.digits:Nope", "opalctl.tasks.absent_module:Digits"])),
    "optimizer_name": st.one_of(NOT_STR, st.sampled_from(["", "adamw", "NotAnOptimizer", "1Adam", "lr_scheduler"])),
    "int": st.one_of(texts, finite, bools, none, lists, dicts),
    "float": st.one_of(NOT_FLOAT, none),
    "optional_float": NOT_FLOAT,
    "optimizer_number": st.one_of(texts, bools, none, lists, dicts, negative, nonfinite),
    "clock": st.one_of(texts.filter(lambda s: s not in ("cpu", "gpu", "wall", "updates")), ints, bools, none, lists),
    "schedule": st.one_of(texts.filter(lambda s: s not in ("constant", "cosine", "linear", "anneal-end")), ints,
                          none, dicts),
    "list": st.one_of(texts, ints, bools, none, dicts),
    "mapping": st.one_of(texts, ints, finite, bools, none, lists),
    "parents": st.one_of(ints, finite, bools, none, lists,
                         st.dictionaries(st.integers(0, 5), st.integers(0, 9), min_size=1, max_size=2)),
}

# mappings that forbid unknown keys (pydantic models, the task's config, torch's optimizer arguments) or whose
# keys must name something that exists (floors name an evaluation split and a metric)
STRICT_MAPPINGS = [(), ("task",), ("task", "config"), ("budget",), ("training",), ("selection",),
                   ("selection", "floors")]
STRICT_MAPPINGS += [("arms", arm) for arm in ARMS] + [("arms", arm, "optimizer") for arm in ARMS]
UNKNOWN_KEYS = st.builds(lambda rest: "x-" + rest, st.text(alphabet="abcdefgxyz0123456789_-. éß数\n\t", max_size=10))

# keys without a default: deleting any of them leaves an invalid protocol
REQUIRED = [("name",), ("task",), ("task", "entry"), ("data",), ("parents",), ("seeds",), ("budget",),
            ("budget", "clock"), ("budget", "amount"), ("training",), ("training", "batch_size"), ("arms",)]
REQUIRED += [("data", split) for split in BASE["data"]]  # digits needs each of its four splits
REQUIRED += [("arms", arm, "optimizer") for arm in ARMS] + [("arms", arm, "optimizer", "name") for arm in ARMS]


def _get(data, path):
    for part in path:
        data = data[part]
    return data


def dump(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=False)


def with_value(path: tuple, value) -> tuple[str, str, str]:
    data = copy.deepcopy(BASE)
    _get(data, path[:-1])[path[-1]] = value
    if KINDS.get(path) == "optimizer_number":  # torch judges the arguments together: the refusal names the optimizer
        return ("wrong type", dump(data), dotted(path[:-1] + ("name",)))
    return ("wrong type", dump(data), dotted(path))


def with_unknown_key(where: tuple, key: str, value) -> tuple[str, str, str]:
    data = copy.deepcopy(BASE)
    _get(data, where)[key] = value
    # a key that is not printable is shown with repr(), so that the refusal stays on one line
    return ("unknown key", dump(data), key if key.isprintable() else repr(key)[1:-1])


def without(path: tuple) -> tuple[str, str, str]:
    data = copy.deepcopy(BASE)
    del _get(data, path[:-1])[path[-1]]
    return ("missing key", dump(data), dotted(path))


# --------------------------------------------------------------------------------------------------------------
# broken YAML, made from the text itself (comments and flow collections included)

LINES = BASE_TEXT.splitlines()


def _code(line: str) -> str:
    return line.split("#", 1)[0]


def _key_line(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#") and ":" in _code(line)


VALUE_LINES = [i for i, line in enumerate(LINES) if _key_line(line) and _code(line).split(":", 1)[1].strip()]
# `key: [...]` or `key: {...}` lines: a flow collection (not a plain value that happens to hold a brace)
FLOW_LINES = [i for i in VALUE_LINES if _code(LINES[i]).split(":", 1)[1].strip()[0] in "[{"]
INDENTED = [i for i, line in enumerate(LINES) if line.startswith("  ") and _key_line(line)]
# an indented key that follows a sibling: shifting it by one column either way breaks the block
SHIFTABLE = [i for i in INDENTED if i - 1 in INDENTED]
# `key: plain value` lines (no flow collection, no comment): a second ": " in the value cannot be parsed
PLAIN = [i for i in VALUE_LINES if not any(c in LINES[i] for c in "[]{}#")]
KEY_LINES = [i for i, line in enumerate(LINES) if _key_line(line)]


def _text(lines: list[str]) -> str:
    return "\n".join(lines) + "\n"


def unclosed(index: int) -> str:
    lines = list(LINES)
    code, comment = _code(lines[index]), lines[index][len(_code(lines[index])):]
    cut = max(code.rfind("]"), code.rfind("}"))
    lines[index] = code[:cut] + code[cut + 1:] + comment
    return _text(lines)


def opened(index: int, bracket: str) -> str:
    lines = list(LINES)
    key, value = lines[index].split(":", 1)
    lines[index] = f"{key}: {bracket}{value.lstrip()}"
    return _text(lines)


def tabbed(index: int) -> str:
    lines = list(LINES)
    lines[index] = "\t" + lines[index][2:]
    return _text(lines)


def shifted(index: int, indent: int) -> str:
    lines = list(LINES)
    lines[index] = " " * indent + lines[index].lstrip(" ")
    return _text(lines)


def stray_colon(index: int, word: str) -> str:
    lines = list(LINES)
    lines[index] = lines[index].rstrip() + f": {word}"
    return _text(lines)


def repeated(index: int) -> str:
    lines = list(LINES)
    lines.insert(index + 1, lines[index])
    return _text(lines)


YAML_CASES = st.one_of(
    st.sampled_from(FLOW_LINES).map(unclosed),
    st.builds(opened, st.sampled_from(VALUE_LINES), st.sampled_from("[{")),
    st.sampled_from(INDENTED).map(tabbed),
    st.builds(shifted, st.sampled_from(SHIFTABLE), st.sampled_from([1, 3])),
    st.builds(stray_colon, st.sampled_from(PLAIN), words),
).map(lambda text: ("broken yaml", text, "the YAML cannot be parsed"))
DUPLICATE_CASES = st.sampled_from(KEY_LINES).map(lambda i: ("repeated key", repeated(i), "appears twice"))

MUTATIONS = st.one_of(
    st.sampled_from(sorted(KINDS, key=repr)).flatmap(lambda path: WRONG[KINDS[path]].map(
        lambda value: with_value(path, value))),
    st.builds(with_unknown_key, st.sampled_from(STRICT_MAPPINGS), UNKNOWN_KEYS, st.integers(0, 9)),
    st.sampled_from(REQUIRED).map(without),
    YAML_CASES,
    DUPLICATE_CASES,
)


# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_folder(digits_init_folder, tmp_path_factory):
    """One private copy of the project: an invalid protocol never writes anything, so it can be shared."""
    folder = tmp_path_factory.mktemp("fuzz") / "project"
    shutil.copytree(digits_init_folder, folder)
    return folder


def assert_refused(folder, case):
    kind, text, expected = case
    for stale in folder.glob("*.lock.json"):
        stale.unlink()
    path = folder / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    result = call_cli("freeze", path)
    assert result.code == 2, f"{kind}: exit {result.code}, not 2\n{text}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert "Traceback" not in result.output, result.output
    assert result.stderr.startswith("opalctl: error: "), result.stderr
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, f"not one line: {result.stderr!r}"
    assert str(path) in result.stderr, result.stderr
    assert expected in result.stderr, f"{kind}: {expected!r} not named in {result.stderr!r}"
    assert result.stdout == ""
    assert not list(folder.glob("*.lock.json")), "an invalid protocol wrote a lock"


def test_the_unmutated_protocol_is_valid(fuzz_folder):
    """The base of every mutation freezes: what the fuzz refuses is the mutation, not the base."""
    path = fuzz_folder / "base.yaml"
    path.write_text(dump(BASE), encoding="utf-8")
    try:
        result = call_cli("freeze", path)
        assert result.code == 0, result.output
    finally:
        for lock in fuzz_folder.glob("*.lock.json"):
            lock.unlink()
        path.unlink()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=MUTATIONS)
def test_fuzzed_invalid_protocols_exit_2_with_one_line(fuzz_folder, case):
    assert_refused(fuzz_folder, case)


@pytest.mark.parametrize("path", REQUIRED, ids=dotted)
def test_every_required_key_deleted_is_refused(fuzz_folder, path):
    assert_refused(fuzz_folder, without(path))


ALL_YAML = ([("unclosed", i, unclosed(i)) for i in FLOW_LINES]
            + [("opened" + b, i, opened(i, b)) for i in VALUE_LINES for b in "[{"]
            + [("tab", i, tabbed(i)) for i in INDENTED]
            + [(f"indent{n}", i, shifted(i, n)) for i in SHIFTABLE for n in (1, 3)]
            + [("colon", i, stray_colon(i, "oops")) for i in PLAIN])


@pytest.mark.parametrize("name, index, text", ALL_YAML, ids=[f"{n}-line{i + 1}" for n, i, _ in ALL_YAML])
def test_every_yaml_corruption_is_refused(fuzz_folder, name, index, text):
    assert_refused(fuzz_folder, ("broken yaml", text, "the YAML cannot be parsed"))


LINE_CASES = ([("tab", i, tabbed(i), i + 1) for i in INDENTED] + [("colon", i, stray_colon(i, "oops"), i + 1) for i in PLAIN]
              + [("repeated", i, repeated(i), i + 2) for i in KEY_LINES])


@pytest.mark.parametrize("name, index, text, line", LINE_CASES, ids=[f"{c[0]}-line{c[1] + 1}" for c in LINE_CASES])
def test_a_tab_a_stray_colon_or_a_repeated_key_names_its_line(fuzz_folder, name, index, text, line):
    path = fuzz_folder / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    result = call_cli("freeze", path)
    assert result.code == 2, result.output
    assert f"{path} line {line}:" in result.stderr, result.stderr


def test_the_case_lists_are_not_empty():
    """Guards the generators: a template change that empties a list would silently weaken the fuzz."""
    for name, cases in [("flow", FLOW_LINES), ("value", VALUE_LINES), ("indented", INDENTED),
                        ("shiftable", SHIFTABLE), ("plain", PLAIN), ("keys", KEY_LINES)]:
        assert len(cases) >= 3, name
    assert len(KINDS) >= 40 and len(REQUIRED) >= 20
