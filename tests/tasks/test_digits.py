"""The built-in ``digits`` task: its split, its sampler, its evaluation and how it refuses a damaged parent."""

from __future__ import annotations

import json
import random
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from opalctl import checkpoints
from opalctl.checkpoints import CheckpointRefused
from opalctl.tasks.digits import NEW, OLD, Digits
from tests import support

SPLITS = ("train", "development", "selection", "retention")


@pytest.fixture(scope="module")
def task():
    return Digits({"hidden": 128, "replay_share": 0.25})


@pytest.fixture(scope="module")
def splits(task, digits_init_folder):
    return task.load({s: digits_init_folder / "data" / "digits" / f"{s}.npz" for s in SPLITS})


@pytest.fixture
def parent(digits_init_folder) -> Path:
    return digits_init_folder / "parents" / "digits" / "seed-1.pt"


def counts(y) -> dict[int, int]:
    values, numbers = np.unique(y, return_counts=True)
    return dict(zip(values.tolist(), numbers.tolist(), strict=True))


# --------------------------------------------------------------------------------------------------------------
# the split


def test_retention_is_exactly_128_rows_of_the_old_classes(splits):
    retention = splits["retention"]
    assert len(retention["ids"]) == len(retention["y"]) == len(retention["x"]) == 128
    assert set(counts(retention["y"])) == set(OLD)
    assert min(counts(retention["y"]).values()) >= 25  # every old class is there, roughly evenly


def test_selection_holds_250_new_class_rows_and_some_old_ones(splits):
    y = splits["selection"]["y"]
    new = np.isin(y, NEW)
    assert int(new.sum()) == 250
    assert {c: n for c, n in counts(y).items() if c in NEW} == {c: 50 for c in NEW}
    assert 0 < int((~new).sum()) and set(y[~new].tolist()) <= set(OLD)


def test_train_holds_the_new_classes_and_flagged_replay_rows(splits):
    train = splits["train"]
    replay = train["replay"].astype(bool)
    assert train["replay"].dtype == np.bool_
    assert set(train["y"][~replay].tolist()) == set(NEW)  # every non-replay row is a new class
    assert set(train["y"][replay].tolist()) == set(OLD)  # and every replay row an old one
    assert 0 < int(replay.sum()) < len(replay) // 2
    assert counts(train["y"][replay]) == {c: 40 for c in OLD}  # replay_per_class


def test_no_row_is_in_two_files(splits):
    seen: dict[int, str] = {}
    for split in SPLITS:
        ids = splits[split]["ids"].tolist()
        assert len(ids) == len(set(ids)), f"{split} repeats a row"
        for row in ids:
            assert row not in seen, f"row {row} is in {seen[row]} and {split}"
            seen[row] = split


def test_the_rows_are_sklearns_digits(splits):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    for split in SPLITS:
        ids = splits[split]["ids"]
        assert np.array_equal(splits[split]["y"], bunch.target[ids]), split
        assert np.array_equal(splits[split]["x"], (bunch.data[ids] / 16.0).astype(np.float32)), split
        assert splits[split]["x"].dtype == np.float32 and splits[split]["y"].dtype == np.int64


# --------------------------------------------------------------------------------------------------------------
# the sampler


def batches(sampler, count):
    return [sampler.next_batch() for _ in range(count)]


def same(a, b) -> bool:
    return (np.array_equal(a.ids, b.ids) and torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets))


def test_a_batch_is_new_rows_plus_a_replay_share(task, splits):
    train = splits["train"]
    replay_ids = set(train["ids"][train["replay"]].tolist())
    for batch in batches(task.sampler(train, seed=1, batch_size=64), 5):
        assert len(batch) == 64 and batch.inputs.shape == (64, 64) and batch.targets.shape == (64,)
        flagged = [row in replay_ids for row in batch.ids.tolist()]
        assert sum(flagged) == 16  # round(64 * 0.25)
        assert set(batch.targets[torch.tensor(flagged)].tolist()) <= set(OLD)
        assert set(batch.targets[~torch.tensor(flagged)].tolist()) <= set(NEW)
        rows = {row: i for i, row in enumerate(train["ids"].tolist())}
        for position, row in enumerate(batch.ids.tolist()):
            assert batch.targets[position].item() == train["y"][rows[row]]


def test_the_first_epoch_of_new_rows_has_no_repeats(task, splits):
    train = splits["train"]
    new_rows = int((~train["replay"]).sum())
    sampler = task.sampler(train, seed=3, batch_size=64)
    seen = []
    for batch in batches(sampler, new_rows // 48):
        seen += [row for row, old in zip(batch.ids.tolist(), np.isin(batch.targets.numpy(), OLD), strict=True) if not old]
    assert len(seen) == len(set(seen))


def test_the_sampler_is_deterministic_and_seeded(task, splits):
    train = splits["train"]
    first = batches(task.sampler(train, seed=7, batch_size=64), 30)
    second = batches(task.sampler(train, seed=7, batch_size=64), 30)
    assert all(same(a, b) for a, b in zip(first, second, strict=True))
    other = batches(task.sampler(train, seed=8, batch_size=64), 30)
    assert not all(np.array_equal(a.ids, b.ids) for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("taken", [0, 1, 11, 12, 13, 40])  # 12 and 13 straddle the end of the first epoch
def test_the_sampler_resumes_exactly_from_its_state(task, splits, taken):
    train = splits["train"]
    uninterrupted = batches(task.sampler(train, seed=5, batch_size=64), taken + 25)
    interrupted = task.sampler(train, seed=5, batch_size=64)
    batches(interrupted, taken)
    state = json.loads(json.dumps(interrupted.state_dict()))  # plain JSON-able data
    resumed = task.sampler(train, seed=5, batch_size=64)
    resumed.load_state_dict(state)
    assert all(same(a, b) for a, b in zip(uninterrupted[taken:], batches(resumed, 25), strict=True))


# --------------------------------------------------------------------------------------------------------------
# build, loss, evaluate


def test_build_loads_the_parent_and_accounts_for_every_tensor(task, parent):
    built = task.build(parent, {}, seed=1)
    payload = checkpoints.load(parent)
    state = built.model.state_dict()
    assert set(state) == set(payload["model"])
    assert all(torch.equal(state[name], payload["model"][name]) for name in state)
    assert [t["name"] for t in built.inherited] == sorted(state)
    assert all(t["sha256"] == checkpoints.tensor_sha256(state[t["name"]]) for t in built.inherited)
    assert built.initialised == []


def test_the_loss_is_a_finite_scalar(task, splits, parent):
    model = task.build(parent, {}, seed=1).model
    loss, details = task.loss(model, task.sampler(splits["train"], 1, 64).next_batch())
    assert loss.dim() == 0 and torch.isfinite(loss) and isinstance(details, dict)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_evaluate_leaves_parameters_and_every_rng_unchanged(task, splits, parent):
    model = task.build(parent, {}, seed=1).model
    model.train()
    torch.manual_seed(1234)
    np.random.seed(99)
    random.seed(7)
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    results = [task.evaluate(model, splits[s]) for s in ("selection", "retention", "development")]
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    assert torch.equal(rng[0], torch.get_rng_state())
    after_numpy = np.random.get_state()
    assert rng[1][0] == after_numpy[0] and np.array_equal(rng[1][1], after_numpy[1]) and rng[1][2:] == after_numpy[2:]
    assert rng[2] == random.getstate()
    assert model.training  # the mode it was in
    assert all(p.grad is None for p in model.parameters())
    assert results == [task.evaluate(model, splits[s]) for s in ("selection", "retention", "development")]


def test_the_parent_knows_the_old_classes_only(task, splits, parent):
    model = task.build(parent, {}, seed=1).model
    retention = task.evaluate(model, splits["retention"])
    selection = task.evaluate(model, splits["selection"])
    assert isinstance(retention["correct"], int) and isinstance(retention["total"], int)
    assert retention["total"] == 128 and retention["correct"] >= 120
    old_rows = int(np.isin(splits["selection"]["y"], OLD).sum())
    assert selection["total"] == 300 and selection["correct"] <= old_rows  # no new class is ever right
    assert retention["loss"] < selection["loss"]


# --------------------------------------------------------------------------------------------------------------
# a damaged parent is refused, naming the file


def member_offset(path: Path, suffix: str) -> int:
    """Where the bytes of the zip member ending with ``suffix`` start in ``path`` (torch stores, never deflates)."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(suffix))
        assert info.compress_type == zipfile.ZIP_STORED
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(30)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_length + extra_length


def copy_parent(parent: Path, tmp_path: Path) -> Path:
    target = tmp_path / "seed-1.pt"
    target.write_bytes(parent.read_bytes())
    return target


def test_a_flipped_byte_in_a_tensor_is_refused(task, parent, tmp_path):
    damaged = copy_parent(parent, tmp_path)
    support.flip_byte(damaged, member_offset(damaged, "/data/0") + 1000)
    with pytest.raises(CheckpointRefused, match="does not match its digest") as caught:
        task.build(damaged, {}, seed=1)
    assert str(damaged) in caught.value.message


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.0])
def test_a_truncated_parent_is_refused(task, parent, tmp_path, keep):
    damaged = copy_parent(parent, tmp_path)
    data = damaged.read_bytes()
    damaged.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointRefused) as caught:
        task.build(damaged, {}, seed=1)
    assert str(damaged) in caught.value.message


def test_a_parent_of_another_hidden_size_is_refused(parent):
    with pytest.raises(CheckpointRefused, match="has shape") as caught:
        Digits({"hidden": 64}).build(parent, {}, seed=1)
    assert str(parent) in caught.value.message


def test_a_parent_with_nan_weights_is_refused(task, parent, tmp_path):
    state = checkpoints.load(parent)["model"]
    state["0.bias"] = state["0.bias"].clone()
    state["0.bias"][3] = float("nan")
    bad = tmp_path / "nan.pt"
    checkpoints.save(bad, state, kind="parent")
    with pytest.raises(CheckpointRefused, match="NaN") as caught:
        task.build(bad, {}, seed=1)
    assert str(bad) in caught.value.message


ALTERED = "its keys or metadata do not match their digest; it was altered"


def test_a_flipped_byte_outside_the_tensors_is_refused(task, parent, tmp_path):
    """One flipped bit in the pickled payload outside the tensors ('parent' -> 'qarent' in kind) is refused by the
    checkpoint's skeleton digest, not by a damaged archive."""
    damaged = copy_parent(parent, tmp_path)
    assert "skeleton_sha256" in checkpoints.load(damaged)
    start = member_offset(damaged, "/data.pkl")
    offset = damaged.read_bytes().index(b"parent", start)
    data = bytearray(damaged.read_bytes())
    data[offset] ^= 0x01  # 'parent' -> 'qarent'
    damaged.write_bytes(bytes(data))
    with pytest.raises(CheckpointRefused, match=ALTERED) as caught:
        checkpoints.load(damaged)
    assert str(damaged) in caught.value.message
    with pytest.raises(CheckpointRefused, match=ALTERED):
        task.build(damaged, {}, seed=1)


@pytest.mark.parametrize("old, new", [(b"abcdef", b"abcdeg"), (b"note", b"nose"), (b"meta", b"mete")],
                         ids=["meta-value", "meta-key", "payload-key"])
def test_a_flipped_byte_in_metadata_or_a_key_is_refused(tmp_path, old, new):
    path = tmp_path / "small.pt"
    checkpoints.save(path, {"w": torch.zeros(3)}, kind="parent", meta={"note": "abcdef"})
    assert checkpoints.load(path)["meta"] == {"note": "abcdef"}  # unaltered, it loads
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new))
    with pytest.raises(CheckpointRefused, match=ALTERED) as caught:
        checkpoints.load(path)
    assert str(path) in caught.value.message


def test_a_training_file_without_new_class_rows_is_refused_as_bad_input():
    from opalctl.errors import BadInput
    from opalctl.tasks.digits import DigitsSampler

    rows = {"x": np.zeros((4, 64), dtype=np.float32), "y": np.zeros(4, dtype=np.int64),
            "ids": np.arange(4, dtype=np.int64), "replay": np.ones(4, dtype=np.int64)}
    with pytest.raises(BadInput, match=r"data\.train\) holds no new-class rows"):
        DigitsSampler(rows, seed=1, batch_size=4, replay_share=0.25, device="cpu")
