"""The ``pylm`` task: deterministic files, whole-file splits, resumable batches, side-effect-free evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from opalctl import checkpoints
from opalctl.checkpoints import CheckpointRefused
from opalctl.errors import BadInput
from opalctl.tasks.common import torch_threads
from opalctl.tasks.pylm import PyLM, stdlib_root

TINY = {"parent_updates": 20}  # the default model shape; a parent that has barely started


def files_under(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a small, shared machine a second thread mostly waits for the first."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pylm")
    task = PyLM(TINY)
    layout = task.prepare(folder, [0])
    data = task.load({split: folder / path for split, path in layout["data"].items()})
    return task, folder, layout, data


def test_config_refuses_unknown_and_inconsistent_settings():
    with pytest.raises(ValidationError):
        PyLM({"widht": 64})
    with pytest.raises(ValidationError, match="multiple of heads"):
        PyLM({"width": 66, "heads": 4})
    with pytest.raises(ValidationError, match="must not share"):
        PyLM({"parent_packages": ["json", "email"], "adapt_packages": ["email"]})
    with pytest.raises(ValidationError):
        PyLM({"adapt_packages": ["../secrets"]})


def test_unknown_package_is_refused_with_a_sentence(tmp_path):
    with pytest.raises(BadInput, match="no package or module 'no_such_package_here'"):
        PyLM({**TINY, "adapt_packages": ["no_such_package_here"]}).prepare(tmp_path, [0])


def test_prepare_is_byte_for_byte_deterministic(prepared, tmp_path):
    _, folder, layout, _ = prepared
    again = PyLM(TINY).prepare(tmp_path, [0])
    assert again == layout == {
        "data": {split: f"data/pylm/{split}.npz" for split in ("train", "development", "selection", "retention")},
        "parents": "parents/pylm/seed-{seed}.pt",
    }
    first, second = files_under(folder), files_under(tmp_path)
    assert sorted(first) == ["data/pylm/development.npz", "data/pylm/retention.npz", "data/pylm/selection.npz",
                             "data/pylm/train.npz", "parents/pylm/seed-0.pt"]
    assert first == second
    assert len(first["data/pylm/train.npz"]) < 400_000
    assert all(len(first[f"data/pylm/{split}.npz"]) < 50_000 for split in ("development", "selection", "retention"))


def test_splits_are_whole_held_out_files_of_the_right_packages(prepared):
    task, _, _, data = prepared
    config = task.config
    files = {split: set(data[split]["files"].tolist()) for split in task.splits}
    for split in ("train", "development", "selection"):
        assert all(name.split("/")[0].removesuffix(".py") in config.adapt_packages for name in files[split])
    assert all(name.split("/")[0].removesuffix(".py") in config.parent_packages for name in files["retention"])
    assert not files["train"] & files["development"] and not files["train"] & files["selection"]
    assert not files["development"] & files["selection"]
    assert not any(part in {"test", "tests"} for name in set().union(*files.values()) for part in name.split("/"))
    assert len(data["train"]["text"]) <= config.train_bytes
    root = stdlib_root()
    span = config.context + 1
    for split in ("development", "selection", "retention"):
        rows = data[split]
        assert rows["windows"].shape == (config.eval_windows, span) and rows["windows"].dtype == np.uint8
        assert rows["ids"].dtype == np.int64 and np.all(np.diff(rows["ids"]) >= span)  # sorted, no overlap
        assert len(set(rows["file"].tolist())) >= 8  # spread over many files, not one long one
        names = rows["files"]
        for window, file_index in zip(rows["windows"], rows["file"], strict=True):
            assert window.tobytes() in (root / str(names[file_index])).read_bytes()


def test_load_reads_only_the_splits_named_and_checks_the_context(prepared):
    task, folder, layout, _ = prepared
    only_train = task.load({"train": folder / layout["data"]["train"]})
    assert set(only_train) == {"train"}
    with pytest.raises(BadInput, match="another context"):
        PyLM({**TINY, "context": 32}).load({"selection": folder / layout["data"]["selection"]})


def test_sampler_is_deterministic_and_resumes_exactly(prepared):
    task, _, _, data = prepared
    sampler = task.sampler(data["train"], seed=3, batch_size=8)
    for _ in range(3):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))
    ahead = [sampler.next_batch() for _ in range(3)]
    resumed = task.sampler(data["train"], seed=3, batch_size=8)
    resumed.load_state_dict(state)
    again = [resumed.next_batch() for _ in range(3)]
    for a, b in zip(ahead, again, strict=True):
        assert np.array_equal(a.ids, b.ids) and a.ids.dtype == np.int64 and len(a) == 8
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    other = task.sampler(data["train"], seed=4, batch_size=8)
    other.load_state_dict(state)
    assert not np.array_equal(other.next_batch().ids, ahead[0].ids)
    with pytest.raises(BadInput):
        resumed.load_state_dict({"batches": -1})


def test_batches_are_windows_inside_one_file(prepared):
    task, _, _, data = prepared
    text, bounds = data["train"]["text"], data["train"]["bounds"]
    span = task.config.context + 1
    sampler = task.sampler(data["train"], seed=0, batch_size=64)
    for _ in range(5):
        batch = sampler.next_batch()
        assert batch.inputs.shape == batch.targets.shape == (64, task.config.context)
        assert torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
        for start, inputs, targets in zip(batch.ids, batch.inputs, batch.targets, strict=True):
            file_index = np.searchsorted(bounds, start, side="right") - 1
            assert start + span <= bounds[file_index + 1]
            assert inputs.tolist() == text[start:start + span - 1].tolist()
            assert targets[-1].item() == int(text[start + span - 1])


def test_evaluate_leaves_parameters_and_rng_untouched(prepared):
    task, folder, _, data = prepared
    model = task.build(folder / "parents/pylm/seed-0.pt", {}, seed=0).model
    model.train()
    before = checkpoints.model_sha256(model.state_dict())
    rng_before = torch.get_rng_state()
    first = task.evaluate(model, data["retention"])
    second = task.evaluate(model, data["retention"])
    assert checkpoints.model_sha256(model.state_dict()) == before
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert model.training
    assert first == second
    assert set(first) == set(task.metrics)
    assert isinstance(first["correct"], int) and isinstance(first["total"], int)
    assert first["total"] == task.config.eval_windows * task.config.context
    assert 0 <= first["correct"] <= first["total"]
    assert first["bits_per_byte"] == pytest.approx(first["loss"] / math.log(2))


def test_build_inherits_the_parent_and_refuses_one_of_the_wrong_width(prepared):
    task, folder, _, _ = prepared
    parent = folder / "parents/pylm/seed-0.pt"
    built = task.build(parent, {}, seed=0)
    payload = checkpoints.load(parent)
    assert built.inherited == checkpoints.describe_tensors(payload["model"]) and not built.initialised
    assert payload["meta"]["task"] == "pylm" and payload["meta"]["updates"] == TINY["parent_updates"]
    with pytest.raises(CheckpointRefused, match="has shape"):
        PyLM({**TINY, "width": 32}).build(parent, {}, seed=0)


def test_fresh_models_are_seeded_without_touching_the_global_rng():
    task = PyLM(TINY)
    rng_before = torch.get_rng_state()
    a, b, c = (task.build(None, {}, seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert a.initialised == b.initialised != c.initialised and not a.inherited
    assert sum(p.numel() for p in a.model.parameters()) == 136_960


def test_parent_beats_an_untrained_model_on_retention(prepared):
    task, folder, _, data = prepared
    parent = task.build(folder / "parents/pylm/seed-0.pt", {}, seed=0).model
    untrained = task.build(None, {}, seed=0).model
    trained_bits = task.evaluate(parent, data["retention"])["bits_per_byte"]
    untrained_bits = task.evaluate(untrained, data["retention"])["bits_per_byte"]
    assert untrained_bits == pytest.approx(8.0, abs=0.1)  # near-uniform over 256 bytes
    assert trained_bits < untrained_bits - 1.0


def test_the_model_trains(prepared):
    task, _, _, data = prepared
    model = task.build(None, {}, seed=0).model
    before = task.evaluate(model, data["development"])["loss"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = task.sampler(data["train"], seed=0, batch_size=16)
    losses = []
    for _ in range(30):
        loss, details = task.loss(model, sampler.next_batch())
        assert details == {} and loss.dim() == 0
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert task.evaluate(model, data["development"])["loss"] < before - 0.5
