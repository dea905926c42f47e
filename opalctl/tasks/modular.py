"""``modular``: a one-layer transformer learning modular multiplication, from a parent that knows subtraction.

Why this task: it is the regime where the optimizer's settings decide whether a model generalises at all. On a
fraction of the table of ``a * b mod p`` a small transformer first memorises its training rows and only later,
if ever, finds the rule that answers the held-out ones ("grokking"); when that happens depends on the learning
rate and above all on the weight decay (without it, it mostly never happens within a short budget). The
parent has learnt ``a - b mod p`` from most of that table; an arm learns multiplication from
``train_fraction`` of its table plus a replay share of the parent's subtraction rows. Multiplication needs other
features than subtraction (it works on discrete logarithms, subtraction on the residues themselves), so learning
it pushes the shared embedding away from what subtraction uses: ``retention`` (held-out subtraction rows the
parent answers almost all of) measures that forgetting, ``selection`` and ``development`` (held-out
multiplication rows) the generalisation.

A row is three tokens, ``a``, ``b`` and the operation (token ``p`` for subtraction, ``p + 1`` for
multiplication), and its answer is one of ``p`` residues, read at the last position. Its id is
``operation * p * p + a * p + b``, so no two rows of the two tables share an id.

Everything is deterministic: the tables are split once with a fixed generator, the model is built on the meta
device and initialised from a seeded ``torch.Generator`` (the global RNG is never touched), it has no dropout
(evaluation needs no RNG), each parent trains with one thread on batches drawn from ``(seed, update)``, each
training batch is drawn from ``(seed, batch index)`` (the sampler's state is one integer), and the files are
written with fixed timestamps, so ``opalctl init modular`` gives the same bytes twice.

Like ``pylm``, this module imports torch at the top: it defines an ``nn.Module``, and it is imported only when a
protocol names this task.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, model_validator

from opalctl import checkpoints
from opalctl.errors import BadInput
from opalctl.tasks.base import Batch, Built, Sampler, Task, TaskConfig
from opalctl.tasks.common import (
    ReplaySampler,
    classification_metrics,
    model_from_parent,
    read_arrays,
    torch_threads,
    write_arrays,
)

SPLIT_SEED = 20_261_203
SUBTRACT, MULTIPLY = 0, 1  # the operations, in the order of their tokens (p, p + 1) and of their row ids
# shares of a table held out for evaluation (of the multiplication table: selection, development; of the
# subtraction table: retention); the training share of multiplication is the config's train_fraction
SELECTION_SHARE = 0.30
DEVELOPMENT_SHARE = 0.15
RETENTION_SHARE = 0.15
# separate numpy streams, so no two purposes ever share random numbers
STREAM_SPLIT = {SUBTRACT: 1, MULTIPLY: 2}
STREAM_PARENT = 11
STREAM_TRAIN = 12


class ModularConfig(TaskConfig):
    modulus: Annotated[int, Field(ge=5, le=211)] = 59
    width: Annotated[int, Field(ge=8, le=1024)] = 128
    heads: Annotated[int, Field(ge=1, le=32)] = 4
    train_fraction: Annotated[float, Field(gt=0, le=0.55)] = 0.4
    replay_share: Annotated[float, Field(ge=0, lt=1)] = 0.25
    parent_updates: Annotated[int, Field(ge=1, le=100_000)] = 1000
    parent_lr: Annotated[float, Field(gt=0)] = 3e-3
    parent_weight_decay: Annotated[float, Field(ge=0)] = 1.0
    parent_batch: Annotated[int, Field(ge=1, le=8192)] = 512

    @model_validator(mode="after")
    def _consistent(self) -> ModularConfig:
        if any(self.modulus % d == 0 for d in range(2, int(self.modulus ** 0.5) + 1)):
            raise ValueError(f"modulus {self.modulus} must be a prime (multiplication mod p is a group only then)")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        return self


# -- the model ---------------------------------------------------------------------------------------------------
class AnswerTransformer(nn.Module):
    """Three tokens in, the answer's logits out: one pre-LayerNorm block whose only query is the last position.

    With one layer only the last position's output is read, so attention takes its query there alone and the MLP
    runs on that position only: the same function as a full block's last position, at a third of its cost.
    """

    def __init__(self, modulus: int, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(modulus + 2, width)
        self.position = nn.Parameter(torch.empty(3, width))
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp_in = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, modulus, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head width)
        attended = F.scaled_dot_product_attention(q[:, :, -1:], k, v)  # the last position attends to all three
        z = x[:, -1] + self.proj(attended.reshape(batch, width))
        z = z + self.mlp_out(F.gelu(self.mlp_in(self.norm2(z))))
        return self.head(self.norm(z))


def _meta_model(config: ModularConfig) -> AnswerTransformer:
    with torch.device("meta"):  # no storage and no random draws: the global RNG is never advanced
        return AnswerTransformer(config.modulus, config.width, config.heads)


def build_model(config: ModularConfig, seed: int | None, device: str = "cpu") -> AnswerTransformer:
    """The model; with a seed, initialised from ``torch.Generator(seed)`` as torch initialises these modules by
    default (embeddings standard normal, linear layers uniform within 1/sqrt(fan-in), norms 1 and 0), positions
    normal 0.02. Large embeddings matter here: with small ones the parent takes several times as long to find
    subtraction."""
    model = _meta_model(config).to_empty(device="cpu")
    if seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                module_name, _, kind = name.rpartition(".")
                if module_name.startswith("norm"):
                    parameter.fill_(1.0 if kind == "weight" else 0.0)
                elif module_name == "embed":
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
                elif name == "position":
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
                else:
                    fan_in = getattr(model, module_name).in_features
                    bound = 1.0 / fan_in ** 0.5
                    parameter.copy_((torch.rand(parameter.shape, generator=generator) * 2 - 1) * bound)
    return model.to(device)


def expected_shapes(config: ModularConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in _meta_model(config).state_dict().items()}


# -- the tables --------------------------------------------------------------------------------------------------
def table(modulus: int, operation: int) -> dict[str, np.ndarray]:
    """Every row of one operation's table, in id order."""
    a, b = np.divmod(np.arange(modulus * modulus, dtype=np.int64), modulus)
    answer = (a - b) % modulus if operation == SUBTRACT else (a * b) % modulus
    tokens = np.stack([a, b, np.full_like(a, modulus + operation)], axis=1)
    return {"x": tokens, "y": answer, "ids": operation * modulus * modulus + a * modulus + b}


def split_tables(config: ModularConfig) -> dict[str, dict[str, np.ndarray]]:
    """The fixed partition: retention and the parent's rows from subtraction; selection, development and the
    arms' rows from multiplication (the rest of the multiplication table is never used)."""
    size = config.modulus ** 2
    rows: dict[str, dict[str, np.ndarray]] = {}

    def take(source: dict[str, np.ndarray], chosen: np.ndarray) -> dict[str, np.ndarray]:
        chosen = np.sort(chosen)
        return {key: value[chosen] for key, value in source.items()}

    subtract = table(config.modulus, SUBTRACT)
    order = np.random.default_rng([SPLIT_SEED, STREAM_SPLIT[SUBTRACT]]).permutation(size)
    held = round(RETENTION_SHARE * size)
    rows["retention"], rows["parent"] = take(subtract, order[:held]), take(subtract, order[held:])

    multiply = table(config.modulus, MULTIPLY)
    order = np.random.default_rng([SPLIT_SEED, STREAM_SPLIT[MULTIPLY]]).permutation(size)
    selection, development = round(SELECTION_SHARE * size), round(DEVELOPMENT_SHARE * size)
    train = round(config.train_fraction * size)
    rows["selection"] = take(multiply, order[:selection])
    rows["development"] = take(multiply, order[selection:selection + development])
    rows["new"] = take(multiply, order[selection + development:selection + development + train])
    if len(rows["new"]["ids"]) == 0 or len(rows["retention"]["ids"]) == 0:
        raise BadInput(f"modulus {config.modulus} leaves no training or retention rows; choose a larger one")
    return rows


class Modular(Task):
    name = "modular"
    Config = ModularConfig
    metrics = {"correct": "higher", "total": "count", "loss": "lower"}
    splits = ("train", "development", "selection", "retention")

    # -- built-in data ---------------------------------------------------------------------------------------
    def prepare(self, folder: Path, seeds: list[int]) -> dict[str, Any]:
        config = self.config
        folder = Path(folder)
        rows = split_tables(config)
        data_folder = Path("data") / "modular"
        parent_folder = Path("parents") / "modular"
        # the arms' training file: the multiplication rows, then every row the parent trained on, flagged replay
        train = {key: np.concatenate([rows["new"][key], rows["parent"][key]]) for key in ("x", "y", "ids")}
        train["replay"] = np.concatenate([np.zeros(len(rows["new"]["ids"]), bool),
                                          np.ones(len(rows["parent"]["ids"]), bool)])
        paths = {"train": data_folder / "train.npz"}
        write_arrays(folder / paths["train"], train)
        for split in ("development", "selection", "retention"):
            paths[split] = data_folder / f"{split}.npz"
            write_arrays(folder / paths[split], rows[split])
        for seed in seeds:
            state = self._train_parent(rows["parent"], seed)
            checkpoints.save(folder / parent_folder / f"seed-{seed}.pt", state, kind="parent",
                             meta={"task": "modular", "seed": int(seed), "operation": "subtraction",
                                   "modulus": config.modulus, "updates": config.parent_updates})
        return {"data": {k: str(v) for k, v in paths.items()}, "parents": str(parent_folder / "seed-{seed}.pt")}

    def _train_parent(self, rows: dict[str, np.ndarray], seed: int) -> dict:
        config = self.config
        with torch_threads(1):
            model = build_model(config, seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=config.parent_lr,
                                          weight_decay=config.parent_weight_decay, betas=(0.9, 0.98))
            x, y = torch.from_numpy(rows["x"]), torch.from_numpy(rows["y"])
            size = min(config.parent_batch, len(y))
            for update in range(config.parent_updates):
                rng = np.random.default_rng([int(seed), STREAM_PARENT, update])
                index = torch.from_numpy(rng.choice(len(y), size=size, replace=False))
                loss = F.cross_entropy(model(x[index]), y[index])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return model.state_dict()

    # -- the interface the driver uses -------------------------------------------------------------------
    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        modulus = self.config.modulus
        splits = {}
        for split, path in data_paths.items():
            path = Path(path)
            required = ("x", "y", "ids", "replay") if split == "train" else ("x", "y", "ids")
            arrays = read_arrays(path, required)
            x, y, ids = arrays["x"], arrays["y"], arrays["ids"]
            if (x.ndim != 2 or x.shape[1] != 3 or x.dtype != np.int64 or y.shape != (len(x),) or ids.shape != (len(x),)
                    or y.dtype != np.int64 or (len(x) and (x[:, :2].max() >= modulus or y.max() >= modulus
                                                           or x.min() < 0 or y.min() < 0
                                                           or x[:, 2].max() > modulus + 1))):
                raise BadInput(f"data file {path} is not a modular split for modulus {modulus} (three int64 tokens "
                               f"and one answer per row); it was prepared for another modulus or task")
            splits[split] = arrays
        return splits

    def build(self, parent_path: Path | None, arm_config: dict, seed: int, device: str = "cpu") -> Built:
        return model_from_parent(build_model, self.config, expected_shapes(self.config), parent_path, seed, device)

    def sampler(self, train: Any, seed: int, batch_size: int, device: str = "cpu") -> Sampler:
        return ReplaySampler(train, seed, batch_size, self.config.replay_share, device,
                             task="modular", new_rows="multiplication rows", stream=STREAM_TRAIN)

    def loss(self, model: Any, batch: Batch) -> tuple[Any, dict]:
        return F.cross_entropy(model(batch.inputs), batch.targets), {}

    def evaluate(self, model: Any, rows: Any) -> dict[str, float | int]:
        return classification_metrics(model, rows)
