"""nanoGPT's recipe as a protocol, trained: docs/recipes.md's ``nanogpt`` arm (AdamW, a linear warm-up, cosine down to
a tenth of the peak, no weight decay on the parameters of fewer than two dimensions) on the small character-level
GPT of tests/tasks/char_gpt_task.py, frozen and run through the command line on a tiny ``updates`` budget. The run's
records are read back: each update's learning rate of each group (``lrs`` in steps.jsonl.gz) against the formula,
and each group's parameters and weight decay (start.json) against nanoGPT's rule. The ``keep`` agent on the
recipe, and on an arm whose groups use the ``norm`` and ``bias`` rules and a name pattern, trains exactly as the
fixed arm (the same steps lines and final weights)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from opalctl.driver.records import read_steps
from tests.support.cli import call_cli, run_cli

TESTS = Path(__file__).resolve().parents[1]
TASK_FILE = TESTS / "tasks" / "char_gpt_task.py"
RECIPES = TESTS.parent / "docs" / "recipes.md"
AMOUNT = 100  # updates: the warm-up of 0.02 is the first 2 (0, then half the peak)


def recipe_arm() -> dict:
    block = RECIPES.read_text(encoding="utf-8").split("```yaml\n", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)["arms"]["nanogpt"]


def arms() -> dict:
    """The recipe, and beside it the other rules (``norm``, ``bias``, a name pattern), each also under the ``keep``
    agent, whose starting program must train exactly as the fixed arm."""
    keep = {"agent": {"backend": "keep", "decisions": 2}}
    fine_tuning = {"optimizer": {"name": "AdamW", "lr": 3.0e-3, "weight_decay": 0.1},
                   "schedule": {"name": "linear", "warmup": 0.1},
                   "groups": [{"match": ["embedding.*", "position"], "lr_scale": 0.5},
                              {"match": ["bias", "norm"], "weight_decay": 0.0}]}
    return {"nanogpt": recipe_arm(), "nanogpt-keep": {**recipe_arm(), **keep},
            "fine-tuning": fine_tuning, "fine-tuning-keep": {**fine_tuning, **keep}}


def char_gpt():
    spec = importlib.util.spec_from_file_location("char_gpt_task_for_recipe", TASK_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("nanogpt-recipe")
    shutil.copy(TASK_FILE, folder / TASK_FILE.name)
    char_gpt().write_project(folder, seeds=(1,))
    protocol = {"name": "shakespeare-char", "task": {"entry": "char_gpt_task:CharGPT"},
                "data": {"train": "data/train.npz", "val": "data/val.npz"}, "parents": "parents/seed-{seed}.pt",
                "seeds": [1], "budget": {"clock": "updates", "amount": AMOUNT}, "training": {"batch_size": 16},
                "arms": arms(),
                "selection": {"denominators": ["val.total"], "nonincreasing": ["val.loss"]}}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(protocol, sort_keys=False))
    with pytest.MonkeyPatch.context() as monkeypatch:  # freeze imports the task: from the folder, then forgotten
        monkeypatch.syspath_prepend(str(folder))
        monkeypatch.setitem(sys.modules, "char_gpt_task", None)
        del sys.modules["char_gpt_task"]
        frozen = call_cli("freeze", folder / "recipe.yaml")
    assert frozen.code == 0, frozen.output
    # the grid and its runs are children, as a user starts them
    env = {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
    done = run_cli("grid", "shakespeare-char.lock.json", "--jobs", "2", cwd=folder, env=env, timeout=600)
    assert done.code == 0, done.output
    (runs,) = (folder / "runs").iterdir()
    return runs


@pytest.fixture(scope="module")
def run_dir(runs) -> Path:
    return runs / "nanogpt" / "seed-1"


def nanogpt_factor(update: int) -> float:
    """nanoGPT's get_lr, as a fraction of the peak, at the budget fraction ``update / AMOUNT``: linear warm-up over
    the first 0.02, then cosine from the peak down to min_lr = a tenth of it over the rest."""
    fraction = update / AMOUNT
    if fraction < 0.02:
        return fraction / 0.02
    decay_ratio = (fraction - 0.02) / (1 - 0.02)
    return 0.1 + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (1.0 - 0.1)


def test_each_groups_learning_rate_at_each_update_is_nanogpts_formula(run_dir):
    lines = list(read_steps(run_dir / "training" / "steps.jsonl.gz"))
    assert [line["update"] for line in lines] == list(range(1, AMOUNT + 1))
    for line in lines:  # the fraction is the budget used before the update
        expected = 1.0e-3 * nanogpt_factor(line["update"] - 1)
        assert line["lrs"] == [pytest.approx(expected, rel=1e-12, abs=1e-18)] * 2, line
    assert lines[0]["lrs"] == [0.0, 0.0]
    assert lines[1]["lrs"] == [5.0e-4, 5.0e-4]
    assert lines[2]["lrs"] == [1.0e-3, 1.0e-3]  # the peak, once the warm-up is over
    assert lines[-1]["lrs"][0] == pytest.approx(1.0e-3 * nanogpt_factor(AMOUNT - 1), rel=1e-12)


def test_the_matrices_alone_are_decayed(run_dir):
    start = json.loads((run_dir / "start.json").read_text())
    named = list(char_gpt().make_model(char_gpt().WIDTH).named_parameters())
    vectors = [name for name, p in named if p.dim() < 2]
    matrices = [name for name, p in named if p.dim() >= 2]
    assert "block.norm1.weight" in vectors and "position" in matrices and "embedding.weight" in matrices
    assert start["groups"] == [{"parameters": vectors, "lr": 1.0e-3, "weight_decay": 0.0},
                               {"parameters": matrices, "lr": 1.0e-3, "weight_decay": 0.1}]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["updates"] == AMOUNT


def test_the_other_rules_group_the_norms_biases_and_embeddings(runs):
    start = json.loads((runs / "fine-tuning" / "seed-1" / "start.json").read_text())
    named = [name for name, _ in char_gpt().make_model(char_gpt().WIDTH).named_parameters()]
    embeddings = ["position", "embedding.weight"]  # the model's order: its own parameter, then its modules' ones
    undecayed = [n for n in named if n.endswith("bias") or "norm" in n]
    assert start["groups"] == [
        {"parameters": embeddings, "lr": 1.5e-3, "weight_decay": 0.1},
        {"parameters": undecayed, "lr": 3.0e-3, "weight_decay": 0.0},
        {"parameters": [n for n in named if n not in embeddings + undecayed], "lr": 3.0e-3, "weight_decay": 0.1}]


@pytest.mark.parametrize("fixed", ["nanogpt", "fine-tuning"])
def test_the_keep_agent_trains_every_group_exactly_as_the_fixed_arm(runs, fixed):
    def lines(arm):
        return [{k: v for k, v in line.items() if k != "wall"}
                for line in read_steps(runs / arm / "seed-1" / "training" / "steps.jsonl.gz")]

    def weights(arm):
        return json.loads((runs / arm / "seed-1" / "report.json").read_text())["final_model_sha256"]

    assert lines(f"{fixed}-keep") == lines(fixed) and weights(f"{fixed}-keep") == weights(fixed)
    assert len(set(map(str, (line["lrs"] for line in lines(fixed))))) > 1  # the schedule moved the rates
