"""A nanoGPT-like case, small enough for the suite: a character-level GPT (one causal attention block, a few
thousand parameters) on text made locally from the Python standard library's own docstrings.

It is the shape of the case issue 26 met (nanoGPT's ``shakespeare_char`` "baby GPT" ported as a task, AdamW against
the heuristic agent on the loss of held-out text), shrunk so a run of 150 updates takes seconds on one thread.
``write_project(folder)`` writes the data, one parent per seed (an untrained model from the seed) and nothing else;
the test writes the protocol. The task entry is ``char_gpt_task:CharGPT``, with the project folder on PYTHONPATH.

Deterministic throughout: the text is the docstrings of a fixed list of stdlib modules, the model has no dropout,
a batch is drawn from ``(seed, batch index)``.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import numpy as np

from opalctl import checkpoints
from opalctl.tasks.base import Batch, Built, Sampler, Task, TaskConfig
from opalctl.tasks.common import read_arrays, write_arrays

MODULES = ("json", "textwrap", "string", "functools", "itertools", "collections", "pathlib", "random", "heapq",
           "bisect", "shutil", "argparse", "dataclasses", "fractions", "statistics")
ALPHABET = "\n abcdefghijklmnopqrstuvwxyz.,:;()'\"-_=0123456789"  # other characters become ' '
CONTEXT = 16
WIDTH = 16
VALIDATION_WINDOWS = 64


class CharGPTConfig(TaskConfig):
    width: int = WIDTH


def text() -> str:
    """The docstrings of ``MODULES`` and their public members, lower-cased onto ``ALPHABET``."""
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for member_name in sorted(vars(module)):
            member = getattr(module, member_name)
            if not member_name.startswith("_") and (inspect.isfunction(member) or inspect.isclass(member)):
                parts.append(inspect.getdoc(member) or "")
    known = set(ALPHABET)
    return "".join(c if c in known else " " for c in "\n".join(parts).lower())


def make_model(width: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

        def forward(self, x):
            q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            return x + self.mlp(self.norm2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(len(ALPHABET), width)
            self.position = nn.Parameter(torch.zeros(CONTEXT, width))
            self.block = Block()
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, len(ALPHABET))

        def forward(self, tokens):
            x = self.embedding(tokens) + self.position[: tokens.shape[1]]
            return self.head(self.norm(self.block(x)))

    return GPT()


def windows(tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return np.stack([tokens[s: s + CONTEXT + 1] for s in starts]).astype(np.int64)


class CharSampler(Sampler):
    fresh_ids = True

    def __init__(self, tokens: np.ndarray, seed: int, batch_size: int):
        self.tokens, self.seed, self.batch_size, self.drawn = tokens, seed, batch_size, 0

    def next_batch(self) -> Batch:
        import torch

        rng = np.random.default_rng([self.seed, self.drawn])
        self.drawn += 1
        starts = rng.integers(0, len(self.tokens) - CONTEXT - 1, size=self.batch_size)
        rows = torch.from_numpy(windows(self.tokens, starts))
        return Batch(ids=starts.astype(np.int64), inputs=rows[:, :-1], targets=rows[:, 1:])

    def state_dict(self) -> dict:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict) -> None:
        self.drawn = int(state["drawn"])


class CharGPT(Task):
    name = "char-gpt"
    Config = CharGPTConfig
    metrics = {"loss": "lower", "total": "count"}
    splits = ("train", "val")

    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        return {split: read_arrays(Path(path), ("tokens", "ids")) for split, path in data_paths.items()}

    def build(self, parent_path, arm_config, seed, device="cpu") -> Built:
        model = make_model(self.config.width)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        payload = checkpoints.load(parent_path, expected_shapes=shapes)
        model.load_state_dict(payload["model"])
        return Built(model=model.to(device), inherited=checkpoints.describe_tensors(payload["model"]))

    def sampler(self, train, seed, batch_size, device="cpu") -> Sampler:
        return CharSampler(train["tokens"], seed, batch_size)

    def loss(self, model, batch):
        import torch.nn.functional as F

        logits = model(batch.inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1)), {}

    def evaluate(self, model, rows) -> dict:
        import torch
        import torch.nn.functional as F

        ids = rows["ids"]
        held = torch.from_numpy(windows(rows["tokens"], ids))
        with torch.no_grad():
            logits = model(held[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), held[:, 1:].reshape(-1))
        return {"loss": float(loss), "total": int(len(ids))}


def write_project(folder: Path, seeds=(1, 2, 3)) -> None:
    """The training text (the first nine tenths), the held-out text's windows, and an untrained parent per seed."""
    import torch

    index = {c: i for i, c in enumerate(ALPHABET)}
    tokens = np.array([index[c] for c in text()], dtype=np.uint8)
    cut = len(tokens) * 9 // 10
    train, held = tokens[:cut], tokens[cut:]
    starts = np.arange(VALIDATION_WINDOWS, dtype=np.int64) * ((len(held) - CONTEXT - 1) // VALIDATION_WINDOWS)
    write_arrays(folder / "data" / "train.npz", {"tokens": train, "ids": np.arange(1, dtype=np.int64)})
    write_arrays(folder / "data" / "val.npz", {"tokens": held, "ids": starts})
    for seed in seeds:
        torch.manual_seed(seed)
        checkpoints.save(folder / "parents" / f"seed-{seed}.pt", make_model(WIDTH).state_dict(), kind="parent")
