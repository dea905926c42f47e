"""The records a run writes now have the shape of those written before issue 29 (tests/data/format_029fb15): the
same files, and in each the same keys in the same order with values of the same types, written the same canonical
way; the same protocol run again gives the same figures where no clock or host enters them (the weights' bits, and so
their digests, are the CPU's: the figures computed from them are compared to a relative 1e-3)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from opalctl.files import canonical_json
from tests.support.runs import Project

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "format_029fb15"
OLD = FIXTURE / "runs_dir" / "digits-586d962ba73c"
# the protocol the fixture's runs were made with (its README)
BUDGET = {"clock": "updates", "amount": 10, "fractions": [0.5, 1.0]}
ARMS = {"adamw": {"optimizer": {"name": "AdamW", "lr": 1.0e-3}}, "high": {"optimizer": {"name": "AdamW", "lr": 3.0e-2}}}
SELECTION = {"denominators": ["selection.total", "retention.total"], "floors": {"retention.correct": 128},
             "improve_any": ["selection.correct"]}
RECORDS = ("start.json", "stage-01.json", "stage-02.json", "last.json", "selected.json", "report.json")


def shape(value):
    """A JSON value's shape: an object's keys in order with their values' shapes, a list's distinct item shapes,
    a scalar's type."""
    if isinstance(value, dict):
        return [(key, shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        shapes = []
        for item in value:
            if shape(item) not in shapes:
                shapes.append(shape(item))
        return ["list", *shapes]
    return type(value).__name__


def files_of(folder: Path) -> list[str]:
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())


@pytest.fixture(scope="module")
def runs_now(digits_template, tmp_path_factory) -> Path:
    monkeypatch = pytest.MonkeyPatch()
    try:
        project = Project(digits_template, tmp_path_factory.mktemp("shapes") / "project", monkeypatch)
        project.freeze(budget=BUDGET, arms=ARMS, selection=SELECTION)
        for arm in ARMS:
            project.run(arm, 1)
        yield project.base
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("arm", ARMS)
def test_a_run_writes_the_files_and_record_shapes_it_wrote_before(runs_now, arm):
    old, new = OLD / arm / "seed-1", runs_now / arm / "seed-1"
    assert files_of(new) == files_of(old)
    for name in RECORDS:
        written = (new / name).read_text()
        value = json.loads(written)
        assert written == canonical_json(value), f"{name} is not written canonically"
        assert shape(value) == shape(json.loads((old / name).read_text())), f"{name} has another shape"
    old_lines = [json.loads(line) for line in gzip.open(old / "training" / "steps.jsonl.gz").read().splitlines()]
    new_lines = [json.loads(line) for line in gzip.open(new / "training" / "steps.jsonl.gz").read().splitlines()]
    assert [shape(line) for line in new_lines] == [shape(line) for line in old_lines]


def test_the_anchor_record_has_the_shape_it_had(runs_now):
    written = (runs_now / "anchors" / "seed-1" / "anchor.json").read_text()
    assert written == canonical_json(json.loads(written))
    assert shape(json.loads(written)) == shape(json.loads((OLD / "anchors" / "seed-1" / "anchor.json").read_text()))


# Digests of weights: the same protocol's weights differ in their last bits between two kinds of CPU (torch's vector
# kernels; the fixture was written on another host than this), and so do the losses and norms computed from them
WEIGHT_DIGESTS = {"sha256", "model_sha256", "anchor_sha256", "final_model_sha256"}
RELATIVE = 1e-3  # what the fixture's host and an AMD EPYC host differ by in the figures from weights: under 3e-4


def assert_same_figures(got, want, where: str) -> None:
    """``got`` is ``want`` but for digests of weights and float figures within ``RELATIVE`` of each other; every
    key, count, decision and label the same."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for key in want:
            if key not in WEIGHT_DIGESTS:
                assert_same_figures(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for index, (a, b) in enumerate(zip(got, want)):
            assert_same_figures(a, b, f"{where}[{index}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=RELATIVE), (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("arm", ARMS)
def test_the_same_protocol_gives_the_same_figures_where_no_clock_enters(runs_now, arm):
    old, new = OLD / arm / "seed-1", runs_now / arm / "seed-1"
    assert_same_figures(json.loads((new / "last.json").read_text()), json.loads((old / "last.json").read_text()),
                        "last.json")
    got, want = (json.loads((folder / "selected.json").read_text()) for folder in (new, old))
    if want["source"] == "anchor":  # the parent's file, where each project lies
        got["checkpoint"]["file"] = want["checkpoint"]["file"]
    assert_same_figures(got, want, "selected.json")
    timed = ("eval_seconds", "process_cpu_seconds", "train_cpu_seconds", "train_wall_seconds", "anchor_sha256")
    for name in ("stage-01.json", "stage-02.json"):
        got, want = (json.loads((folder / name).read_text()) for folder in (new, old))
        assert_same_figures({k: v for k, v in got.items() if k not in timed},
                            {k: v for k, v in want.items() if k not in timed}, name)
    got, want = (json.loads((folder / "report.json").read_text()) for folder in (new, old))
    for key in ("selected", "promoted_stages", "rows_digest", "updates", "examples_seen",
                "parameter_change", "anchor_metrics", "limitations"):
        assert_same_figures(got[key], want[key], f"report.json {key}")
