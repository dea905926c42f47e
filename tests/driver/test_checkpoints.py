"""Checkpoints that can be trusted: every refusal is a CheckpointRefused naming the file."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

from opalctl import checkpoints
from opalctl.checkpoints import CheckpointRefused
from opalctl.errors import OpalctlError


def model_state():
    generator = torch.Generator().manual_seed(0)
    return {
        "0.weight": torch.randn(32, 16, generator=generator),
        "0.bias": torch.randn(32, generator=generator),
        "2.weight": torch.randn(10, 32, generator=generator),
        "2.bias": torch.zeros(10),
    }


def extra_state():
    return {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 4)}}},
            "sampler": {"epoch": 1, "position": 7}}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "model.pt"
    record = checkpoints.save(path, model_state(), kind="stage", extra=extra_state(), meta={"update": 5})
    return path, record


def refused(path, match=None, **kwargs) -> str:
    with pytest.raises(CheckpointRefused) as info:
        checkpoints.load(path, **kwargs)
    message = str(info.value)
    assert str(path) in message, f"the refusal must name the file: {message}"
    assert "\n" not in message and isinstance(info.value, OpalctlError)
    if match is not None:
        assert match in message, message
    return message


def rewrite(path, change):
    """Load a checkpoint without checks, change it, save it back as a well-formed file (digests left as they were)."""
    payload = torch.load(path, weights_only=True)
    change(payload)
    torch.save(payload, path)


def test_a_checkpoint_loads_back_bit_for_bit(saved):
    path, record = saved
    payload = checkpoints.load(path, expected_shapes={k: tuple(v.shape) for k, v in model_state().items()})
    for name, tensor in model_state().items():
        assert torch.equal(payload["model"][name], tensor)
    assert payload["model_sha256"] == record["model_sha256"] == checkpoints.model_sha256(model_state())
    assert torch.equal(payload["extra"]["optimizer"]["state"][0]["exp_avg"], torch.ones(4, 4))
    assert payload["meta"] == {"update": 5} and payload["kind"] == "stage"
    assert record["bytes"] == path.stat().st_size
    assert not list(path.parent.glob(".*.tmp")), "the temporary file is renamed, not left behind"


def test_model_digest_depends_on_every_name_dtype_shape_and_byte():
    state = model_state()
    digest = checkpoints.model_sha256(state)
    assert checkpoints.model_sha256(dict(reversed(list(state.items())))) == digest  # order of insertion is irrelevant
    changed = dict(state, **{"2.bias": state["2.bias"].clone()})
    changed["2.bias"][3] = 1e-30
    assert checkpoints.model_sha256(changed) != digest
    assert checkpoints.model_sha256(dict(state, **{"2.bias": state["2.bias"].double()})) != digest
    assert checkpoints.model_sha256(dict(state, **{"2.bias": state["2.bias"].reshape(2, 5)})) != digest
    renamed = {("3.bias" if k == "2.bias" else k): v for k, v in state.items()}
    assert checkpoints.model_sha256(renamed) != digest


@pytest.mark.parametrize("keep", [0, 1, 100, 0.5, -1, -22])
def test_a_truncated_checkpoint_is_refused(saved, keep):
    path, _ = saved
    data = path.read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    path.write_bytes(data[:size])
    refused(path, "cannot be read")


def test_one_flipped_byte_inside_a_tensor_is_refused(saved):
    path, _ = saved
    data = bytearray(path.read_bytes())
    raw = checkpoints.tensor_bytes(model_state()["0.weight"])
    offset = data.find(raw)
    assert offset > 0, "the tensor's bytes are stored as they are"
    data[offset + 777] ^= 0x01
    path.write_bytes(bytes(data))
    refused(path, "'0.weight' does not match its digest")


def test_an_altered_tensor_in_a_well_formed_file_is_refused(saved):
    path, _ = saved

    def change(payload):
        payload["model"]["2.bias"][0] += 1.0

    rewrite(path, change)
    refused(path, "'2.bias' does not match its digest")


def test_an_altered_optimizer_state_is_refused(saved):
    path, _ = saved

    def change(payload):
        payload["extra"]["optimizer"]["state"][0]["exp_avg"][1, 1] = 2.0

    rewrite(path, change)
    refused(path, "saved state")


def test_a_tensor_added_without_a_digest_is_refused(saved):
    path, _ = saved
    rewrite(path, lambda payload: payload["model"].__setitem__("4.weight", torch.zeros(2)))
    refused(path, "without digests")


def test_a_model_digest_that_does_not_match_the_tensors_is_refused(saved):
    path, _ = saved
    rewrite(path, lambda payload: payload.__setitem__("model_sha256", "0" * 64))
    refused(path, "model digest")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_tensor_is_refused(tmp_path, bad):
    state = model_state()
    state["0.weight"][5, 5] = bad
    path = tmp_path / "nan.pt"
    checkpoints.save(path, state, kind="stage")
    refused(path, "'0.weight' holds NaN or infinite values")
    # a resume checkpoint may hold what the run held; it is then loaded on request
    value = checkpoints.load(path, require_finite=False)["model"]["0.weight"][5, 5].item()
    assert (value != value) if bad != bad else value == bad


def test_wrong_shapes_are_refused(saved):
    path, _ = saved
    shapes = {k: tuple(v.shape) for k, v in model_state().items()}
    message = refused(path, expected_shapes={**shapes, "0.weight": (16, 32)})
    assert "'0.weight'" in message and "(32, 16)" in message and "(16, 32)" in message
    refused(path, "missing", expected_shapes={**shapes, "4.weight": (1,)})
    refused(path, "unexpected", expected_shapes={k: v for k, v in shapes.items() if k != "2.bias"})


def test_a_checkpoint_over_the_size_limit_is_refused_before_it_is_read(saved, monkeypatch):
    path, record = saved
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a file over the limit must not be read"))
    refused(path, "over the limit", limit_bytes=record["bytes"] - 1)
    monkeypatch.undo()
    assert checkpoints.load(path, limit_bytes=record["bytes"])["model_sha256"] == record["model_sha256"]


def test_a_missing_file_and_a_foreign_file_are_refused(tmp_path):
    refused(tmp_path / "absent.pt", "does not exist")
    foreign = tmp_path / "foreign.pt"
    torch.save({"model": model_state()}, foreign)
    refused(foreign, "not an opalctl checkpoint")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    refused(junk, "cannot be read")


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_opening_a_checkpoint_never_runs_code(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"format": checkpoints.FORMAT, "model": {}, "digests": {}, "evil": Payload(marker)}, path)
    refused(path, "cannot be read")
    assert not marker.exists()


def test_stored_members_really_are_the_tensor_bytes(saved):
    """Guards the byte-flip test above: torch stores tensors uncompressed, so a flipped byte reaches the data."""
    path, _ = saved
    with zipfile.ZipFile(io.BytesIO(path.read_bytes())) as archive:
        assert all(info.compress_type == zipfile.ZIP_STORED for info in archive.infolist())


def test_every_rng_state_goes_through_a_resume_checkpoint_and_comes_back_exactly(tmp_path):
    """torch, numpy and Python's random, saved with a checkpoint, loaded with weights_only and set again: the
    draws that follow are those that followed the save (Python's state is kept as one int64 tensor)."""
    import random

    import numpy as np

    from opalctl.driver.evaluation import _same_rng, rng_state, set_rng_state

    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    random.gauss(0, 1)  # leaves a cached gauss value in Python's state
    state = rng_state()
    expected = (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(1).item())
    checkpoints.save(tmp_path / "resume.pt", {"w": torch.zeros(1)}, kind="resume", extra={"rng": state})
    loaded = checkpoints.load(tmp_path / "resume.pt")["extra"]["rng"]
    assert isinstance(loaded["python"][1], torch.Tensor) and loaded["python"][1].dtype == torch.int64
    assert _same_rng(loaded, state) == []
    set_rng_state(loaded)
    assert (random.random(), random.gauss(0, 1), np.random.rand(), torch.rand(1).item()) == expected
    assert _same_rng(rng_state(), loaded) == ["torch", "numpy", "python random"]


def test_a_checkpoint_replaces_the_old_one_only_once_what_it_counts_on_is_on_the_disk(saved):
    """``before_replace`` (the steps helper's reply, for a resume checkpoint) runs after the new file is written
    and before the rename; when it fails, the old checkpoint stays whole and no temporary file is left."""
    path, record = saved
    order = []

    def wait_for_records():
        order.append(("waited", path.read_bytes() == old))

    old = path.read_bytes()
    checkpoints.save(path, model_state(), kind="stage", meta={"update": 6}, before_replace=wait_for_records)
    assert order == [("waited", True)], "the old file was still in place while the records were awaited"
    assert checkpoints.load(path)["meta"] == {"update": 6}

    old = path.read_bytes()

    def records_failed():
        raise OpalctlError("the steps helper stopped")

    with pytest.raises(OpalctlError, match="stopped"):
        checkpoints.save(path, model_state(), kind="stage", meta={"update": 7}, before_replace=records_failed)
    assert path.read_bytes() == old and sorted(p.name for p in path.parent.iterdir()) == [path.name]


class TiedLanguageModel(torch.nn.Module):
    """An output layer that shares the embedding's weight, as GPT-2's does."""

    def __init__(self, vocabulary: int = 512, width: int = 64):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocabulary, width)
        self.head = torch.nn.Linear(width, vocabulary, bias=False)
        self.head.weight = self.embedding.weight


def test_a_tied_weight_is_stored_once_and_loads_back_tied_with_the_same_model_digest(tmp_path):
    torch.manual_seed(0)
    model = TiedLanguageModel()
    state = model.state_dict()
    assert state["head.weight"].data_ptr() == state["embedding.weight"].data_ptr()  # both names, one tensor
    one_copy = model.embedding.weight.numel() * model.embedding.weight.element_size()
    record = checkpoints.save(tmp_path / "tied.pt", state, kind="stage")
    assert one_copy <= record["bytes"] < one_copy * 1.2, (record["bytes"], one_copy)
    untied = {name: tensor.clone() for name, tensor in state.items()}  # the digest is per name, not per memory
    assert record["model_sha256"] == checkpoints.model_sha256(untied)

    payload = checkpoints.load(tmp_path / "tied.pt")
    assert payload["model"]["head.weight"].data_ptr() == payload["model"]["embedding.weight"].data_ptr()
    assert payload["model_sha256"] == record["model_sha256"]
    fresh = TiedLanguageModel()
    fresh.load_state_dict(payload["model"])
    assert fresh.head.weight is fresh.embedding.weight
    assert torch.equal(fresh.embedding.weight, model.embedding.weight)


def test_a_checkpoint_written_before_ties_were_kept_still_loads_as_it_did(tmp_path):
    """What the previous writer produced, a separate copy per name with each name's digest, reads unchanged."""
    torch.manual_seed(0)
    state = {name: tensor.clone() for name, tensor in TiedLanguageModel().state_dict().items()}
    payload = {"format": checkpoints.FORMAT, "kind": "stage", "model": state,
               "model_sha256": checkpoints.model_sha256(state),
               "digests": {name: checkpoints.tensor_sha256(tensor) for name, tensor in state.items()},
               "extra": {}, "extra_digests": {}, "meta": {}}
    payload["skeleton_sha256"] = checkpoints.skeleton_sha256(payload)
    torch.save(payload, tmp_path / "old.pt")
    loaded = checkpoints.load(tmp_path / "old.pt")
    assert loaded["model_sha256"] == checkpoints.model_sha256(state)
    fresh = TiedLanguageModel()
    fresh.load_state_dict(loaded["model"])
    assert fresh.head.weight is fresh.embedding.weight and torch.equal(fresh.head.weight, state["head.weight"])
