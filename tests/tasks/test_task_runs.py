"""The ``modular`` and ``illcond`` built-in tasks end to end: ``opalctl init`` writes a protocol that freezes, and
formal runs of their templates' arms are deterministic on the ``updates`` clock (a run in this process and one in a
fresh process end with the same digests).

The runs are of the ``agent`` arm: the template's AdamW with the heuristic agent steering it, so a run takes every
step of the ``adamw`` arm's (the task's data, model, optimizer, stages and evaluations) and the agent's besides;
the bare ``adamw`` arm's determinism is tests/tasks/test_shapes_runs.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opalctl.tasks import BUILTIN, make_task
from opalctl.tasks.builtin import protocol_text
from tests.support.cli import call_cli

TASKS = ("illcond", "modular")
# a tiny model and parent for each task, so that a run takes seconds; the protocol is otherwise the template's
TINY = {"modular": {"modulus": 23, "width": 32, "heads": 4, "parent_updates": 50, "parent_batch": 128},
        "illcond": {"dimension": 8, "condition": 100.0, "hidden": 16, "parent_updates": 100}}
UPDATES = 30
PARENT_UPDATES = 50  # the init test's parents: a short training of the template's model


@pytest.mark.parametrize("name", TASKS)
def test_init_writes_a_protocol_that_freezes(name, tmp_path):
    """What ``opalctl init NAME --seeds 1`` does (the template's protocol, the task's data and one parent of the
    template's model), with the parent trained for ``PARENT_UPDATES`` rather than the template's thousands (no
    assertion reads the parent's quality; bench/suite_targets.py's suite freeze makes whole ones); then ``opalctl
    freeze``."""
    from opalctl.tasks.builtin import init

    folder = tmp_path / name
    body = init(name, folder, seeds=[1], config={"parent_updates": PARENT_UPDATES})
    written = sorted(Path(f["path"]).relative_to(folder).as_posix() for f in body["files"])
    assert written == sorted([f"{name}.yaml", f"parents/{name}/seed-1.pt"]
                             + [f"data/{name}/{split}.npz" for split in ("development", "retention", "selection",
                                                                          "train")])
    assert (folder / f"{name}.yaml").read_text(encoding="utf-8") == protocol_text(name, [1])
    frozen = call_cli("freeze", folder / f"{name}.yaml", "--json")
    assert frozen.code == 0, frozen.output
    assert set(yaml.safe_load(protocol_text(name, [1]))["arms"]) >= {"adamw", "adamw-cosine", "agent",
                                                                      "adamw-anneal-end"}


@pytest.fixture(scope="module", params=TASKS)
def tiny_lock(request, tmp_path_factory) -> tuple[str, Path]:
    """A tiny project of the task, frozen: the template with a small model and a budget of 30 updates."""
    from opalctl.protocol.freeze import freeze

    name = request.param
    folder = tmp_path_factory.mktemp(name)
    protocol = yaml.safe_load(protocol_text(name, [1]))
    protocol["task"]["config"] = {**protocol["task"]["config"], **TINY[name]}
    protocol["budget"] = {"clock": "updates", "amount": UPDATES, "threads": 1, "fractions": [0.5, 1.0]}
    protocol["training"]["batch_size"] = 32
    make_task(BUILTIN[name], protocol["task"]["config"]).prepare(folder, [1])
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(protocol, sort_keys=False), encoding="utf-8")
    return name, Path(freeze(folder / f"{name}.yaml")["lock"])


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def run_folder(runs: Path, arm: str) -> Path:
    (found,) = runs.glob(f"*/{arm}/seed-1")
    return found


def stages(folder: Path) -> list[dict]:
    return [read(path) for path in sorted(folder.glob("stage-*.json"))]


def test_two_runs_of_the_agent_arm_end_with_the_same_digests(tiny_lock, tmp_path):
    from opalctl.driver.run import run

    name, lock = tiny_lock
    arm = "agent"
    run(lock, arm, 1, runs_dir=tmp_path / "first")
    child = subprocess.run([sys.executable, "-m", "opalctl", "run", str(lock), "--arm", arm, "--seed", "1",
                            "--runs-dir", str(tmp_path / "second"), "--json"], capture_output=True, text=True,
                           timeout=240)
    assert child.returncode == 0, child.stderr[-3000:]
    first, second = run_folder(tmp_path / "first", arm), run_folder(tmp_path / "second", arm)
    one, two = read(first / "report.json"), read(second / "report.json")
    assert one["updates"] == two["updates"] == UPDATES
    assert one["rows_digest"] == two["rows_digest"]
    assert one["final_model_sha256"] == two["final_model_sha256"]
    first_stages, second_stages = stages(first), stages(second)
    assert [s["update"] for s in first_stages] == [UPDATES // 2, UPDATES]
    assert [(s["metrics"], s["checkpoint"]["model_sha256"], s["promoted"]) for s in first_stages] == \
        [(s["metrics"], s["checkpoint"]["model_sha256"], s["promoted"]) for s in second_stages]
    assert set(first_stages[-1]["metrics"]) == {f"{split}.{metric}" for split in ("development", "selection",
                                                                                 "retention")
                                                for metric in make_task(BUILTIN[name], TINY[name]).metrics}
