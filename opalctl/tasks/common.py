"""Helpers shared by the built-in tasks: byte-for-byte deterministic array files, the thread setting, and the
sampler that mixes new rows with a replay share of the parent's.

``numpy.savez`` stamps each member with the current time, so two ``opalctl init`` runs would write different
bytes. ``write_arrays`` writes the same ``.npz`` layout with a fixed timestamp and sorted members instead, and
``read_arrays`` never unpickles.
"""

from __future__ import annotations

import contextlib
import io
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from opalctl import checkpoints
from opalctl.errors import BadInput
from opalctl.files import atomic_write_bytes
from opalctl.tasks.base import Batch, Built, Sampler

FIXED_TIME = (1980, 1, 1, 0, 0, 0)


def write_arrays(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=FIXED_TIME)
            info.external_attr = 0o644 << 16
            archive.writestr(info, member.getvalue())
    atomic_write_bytes(path, buffer.getvalue())


def read_arrays(path: Path, required: tuple[str, ...]) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise BadInput(f"data file {path} does not exist; run `opalctl init` or fix the protocol's data paths") from None
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise BadInput(f"data file {path} cannot be read as arrays ({error}); regenerate it") from None
    missing = [name for name in required if name not in arrays]
    if missing:
        raise BadInput(f"data file {path} lacks the arrays {', '.join(missing)}; it was not written for this task")
    return arrays


def model_from_parent(build_model: Callable[..., Any], config: Any, expected_shapes: dict, parent_path: Path | None,
                      seed: int, device: str) -> Built:
    """A built-in task's ``build``: with no parent, a model set up fresh from ``seed`` on ``device``; else the
    parent's weights, loaded through ``checkpoints.load`` (a damaged or mismatched parent refused in a sentence)
    into a model of ``config``'s shape. ``build_model(config, seed, device="cpu")`` makes the model."""
    if parent_path is None:
        model = build_model(config, seed, device)
        return Built(model=model, initialised=checkpoints.describe_tensors(model.state_dict()))
    payload = checkpoints.load(parent_path, expected_shapes=expected_shapes)
    model = build_model(config, None)
    model.load_state_dict(payload["model"])
    return Built(model=model.to(device), inherited=checkpoints.describe_tensors(payload["model"]))


def classification_metrics(model: Any, rows: Any) -> dict[str, float | int]:
    """A classifying built-in task's ``evaluate``: ``rows["x"]`` through the model in eval mode (its mode restored
    after), scored against the class indices ``rows["y"]``: rows right, rows in all, and the mean cross-entropy."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    x = torch.from_numpy(rows["x"]).to(device)
    y = torch.from_numpy(rows["y"]).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(x)
            loss = float(F.cross_entropy(logits, y, reduction="sum").item())
            correct = int((logits.argmax(dim=1) == y).sum().item())
    finally:
        model.train(was_training)
    total = int(len(y))
    return {"correct": correct, "total": total, "loss": loss / max(1, total)}


@contextlib.contextmanager
def torch_threads(count: int):
    """Run a block with a fixed intra-op thread count (parents must not depend on the machine's core count)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class ReplaySampler(Sampler):
    """Batches of new rows plus a replay share of the parent's rows, for a training file with ``x``, ``y``,
    ``ids`` and a boolean ``replay`` flag per row.

    A batch holds ``batch_size - round(batch_size * replay_share)`` new rows and the rest replay rows (fewer when
    a pool is smaller), each drawn without repeats inside the batch. Batch ``n`` is drawn from
    ``(seed, stream, n)``, so the sampler's state is one integer and resuming costs nothing.
    """

    fresh_ids = True  # each batch's ids are a new array

    def __init__(self, train: dict[str, Any], seed: int, batch_size: int, replay_share: float, device: str, *,
                 task: str, new_rows: str, stream: int):
        import torch

        self.task = task
        self.seed = int(seed)
        self.stream = int(stream)
        self.device = device
        replay = train["replay"].astype(bool)
        self.pools = [np.flatnonzero(~replay), np.flatnonzero(replay)]
        replay_count = int(round(batch_size * replay_share)) if len(self.pools[1]) else 0
        self.counts = [min(batch_size - replay_count, len(self.pools[0])), min(replay_count, len(self.pools[1]))]
        if self.counts[0] == 0:
            raise BadInput(f"the training file (data.train) holds no {new_rows}, only replay rows; give a file "
                           f"`opalctl init {task}` writes, or one with rows whose replay flag is 0")
        self.x = torch.from_numpy(train["x"]).to(device)
        self.y = torch.from_numpy(train["y"]).to(device)
        self.ids = train["ids"]
        self.batches = 0

    def next_batch(self) -> Batch:
        import torch

        rng = np.random.default_rng([self.seed, self.stream, self.batches])
        rows = np.concatenate([rng.choice(pool, size=count, replace=False)
                               for pool, count in zip(self.pools, self.counts, strict=True)])
        index = torch.from_numpy(rows).to(self.device)
        self.batches += 1
        return Batch(ids=self.ids[rows], inputs=self.x.index_select(0, index), targets=self.y.index_select(0, index))

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        batches = state.get("batches") if isinstance(state, dict) else None
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise BadInput(f"the {self.task} sampler state must be {{'batches': a count}}, not {state!r}")
        self.batches = batches
