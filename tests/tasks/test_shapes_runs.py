"""The ``shapes`` built-in task end to end: ``opalctl init shapes`` writes a protocol that freezes, whose target the
time-to-target rule reads, and formal runs are deterministic on the ``updates`` clock (a run in this process and one
in a fresh process end with the same digests).

That the template's tuned baseline (its ``adamw`` arm at the template's budget) reaches that target on seed 1 after
its first stage and within the budget is a long run's figure: ``bench/suite_targets.py`` re-measures it (``make
bench``; docs/tasks.md holds the figures)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from opalctl.compare.target import TargetRule
from opalctl.protocol.lock import read_lock
from opalctl.tasks import BUILTIN, make_task
from opalctl.tasks.builtin import protocol_text
from tests.support.cli import call_cli, run_cli

SPLITS = ("development", "retention", "selection", "train")
TINY = {"channels": 8, "groups": 4, "parent_updates": 50}
UPDATES = 30
PARENT_UPDATES = 50  # the init test's parent: a short training of the template's model


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def run_folder(runs: Path, arm: str) -> Path:
    (found,) = runs.glob(f"*/{arm}/seed-1")
    return found


def stages(folder: Path) -> list[dict]:
    return [read(path) for path in sorted(folder.glob("stage-*.json"))]


def test_init_writes_a_protocol_that_freezes_whose_target_the_rule_reads(tmp_path):
    """What ``opalctl init shapes --seeds 1`` does (the template's protocol, the task's data and one parent of the
    template's model), with the parent trained for ``PARENT_UPDATES`` rather than the template's 2,000 (no assertion
    reads the parent's quality; bench/suite_targets.py runs a whole init); then ``opalctl freeze``."""
    from opalctl.tasks.builtin import init

    folder = tmp_path / "shapes"
    body = init("shapes", folder, seeds=[1], config={"parent_updates": PARENT_UPDATES})
    written = sorted(Path(f["path"]).relative_to(folder).as_posix() for f in body["files"])
    assert written == sorted(["shapes.yaml", "parents/shapes/seed-1.pt"]
                             + [f"data/shapes/{split}.npz" for split in SPLITS])
    assert (folder / "shapes.yaml").read_text(encoding="utf-8") == protocol_text("shapes", [1])
    frozen = call_cli("freeze", folder / "shapes.yaml", "--json")
    assert frozen.code == 0, frozen.output
    template = yaml.safe_load(protocol_text("shapes", [1]))
    assert set(template["arms"]) >= {"adamw", "adamw-cosine", "agent", "adamw-anneal-end"}
    rule = TargetRule.of(read_lock(frozen.json()["lock"]))
    assert rule is not None and rule.higher and rule.metric == "selection.correct"
    assert rule.value == template["target"]["value"]


@pytest.fixture(scope="module")
def tiny_lock(tmp_path_factory) -> Path:
    """A tiny project of the task, frozen: the template with a small model and a budget of 30 updates."""
    from opalctl.protocol.freeze import freeze

    folder = tmp_path_factory.mktemp("shapes-tiny")
    protocol = yaml.safe_load(protocol_text("shapes", [1]))
    protocol["task"]["config"] = {**protocol["task"]["config"], **TINY}
    protocol["budget"] = {"clock": "updates", "amount": UPDATES, "threads": 1, "fractions": [0.5, 1.0]}
    protocol["training"]["batch_size"] = 32
    make_task(BUILTIN["shapes"], protocol["task"]["config"]).prepare(folder, [1])
    (folder / "shapes.yaml").write_text(yaml.safe_dump(protocol, sort_keys=False), encoding="utf-8")
    return Path(freeze(folder / "shapes.yaml")["lock"])


def test_two_runs_end_with_the_same_digests(tiny_lock, tmp_path):
    from opalctl.driver.run import run

    run(tiny_lock, "adamw", 1, runs_dir=tmp_path / "first")
    child = run_cli("run", tiny_lock, "--arm", "adamw", "--seed", "1", "--runs-dir", tmp_path / "second", "--json")
    assert child.code == 0, child.stderr[-3000:]
    first, second = run_folder(tmp_path / "first", "adamw"), run_folder(tmp_path / "second", "adamw")
    one, two = read(first / "report.json"), read(second / "report.json")
    assert one["updates"] == two["updates"] == UPDATES
    assert one["rows_digest"] == two["rows_digest"]
    assert one["final_model_sha256"] == two["final_model_sha256"]
    first_stages, second_stages = stages(first), stages(second)
    assert [s["update"] for s in first_stages] == [UPDATES // 2, UPDATES]
    assert [(s["metrics"], s["checkpoint"]["model_sha256"], s["promoted"]) for s in first_stages] == \
        [(s["metrics"], s["checkpoint"]["model_sha256"], s["promoted"]) for s in second_stages]
    assert all(math.isfinite(value) for s in first_stages for value in s["metrics"].values())
    assert set(first_stages[-1]["metrics"]) == {f"{split}.{metric}" for split in ("development", "selection",
                                                                                 "retention")
                                                for metric in make_task(BUILTIN["shapes"], TINY).metrics}
