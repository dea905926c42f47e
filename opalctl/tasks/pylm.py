"""``pylm``: a byte-level transformer language model over the Python standard library's own source files.

Why this task: it is a second, differently shaped tension beside ``digits``, on text every Python installation
already ships (no downloads). The parent is a small causal transformer trained on one set of stdlib packages
(``parent_packages``: email, json, http, ...). An arm starts from it and adapts to another set
(``adapt_packages``: asyncio, concurrent, multiprocessing). Code in the new packages shares the language with the
old ones but not the vocabulary of names and idioms, so adapting helps ``selection`` (held-out files of the new
packages) while it can erode ``retention`` (held-out files of the parent's packages). ``development`` is a second
held-out set of new-package files an agent may look at.

The split is by whole files, never inside one, so a held-out window is text the parent (or the arm) never saw.
Which file goes where is decided by a salted SHA-256 of its path relative to the stdlib, not by its position in a
listing, so a Python release that adds or drops a file moves only that file. Files are taken under the packages'
folders (``.py`` only, in sorted order), skipping ``test``, ``tests``, ``idlelib`` and ``site-packages`` folders.

Rows: an evaluation split is a fixed set of ``eval_windows`` windows of ``context + 1`` bytes, each inside one file
and none overlapping, with its offset in the split's held-out text as its row id. The training file is one uint8
stream of the adapt packages' training files (capped at ``train_bytes``) plus their boundaries; the sampler draws
windows that never cross a boundary, and a batch's row ids are the windows' start offsets.

Everything is deterministic: the model is built on the meta device and initialised from a seeded
``torch.Generator`` (the global RNG is never touched), has no dropout (so evaluation needs no RNG), each parent
trains with one thread and windows drawn from ``(seed, update)``, each training batch is drawn from
``(seed, batch index)`` (so the sampler's state is one integer), and the files are written with fixed timestamps.
``opalctl init pylm`` gives the same bytes twice on the same Python; the text itself comes from the installed
stdlib, so another Python version gives other (equally deterministic) files, and the parents record the version.

Sizing: a second thread mostly waits on this small model, so one thread sees several times the updates of two
under a CPU budget. The default parent is barely past byte statistics and an arm improves retention and selection
alike; the tension between them (forgetting) appears only with a longer parent, so a protocol that wants forgetting
to arbitrate should set ``parent_updates`` to 1,000 or more (the measured figures are in bench/README.md).

Unlike ``digits``, this module imports torch at the top: it defines ``nn.Module`` classes, and it is imported
only when a protocol names this task.
"""

from __future__ import annotations

import hashlib
import math
import platform
import sysconfig
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
from opalctl.tasks.common import model_from_parent, read_arrays, torch_threads, write_arrays

SPLIT_SALT = "opalctl-pylm-split-2024"
SPLIT_SEED = 20_240_611
SKIP_FOLDERS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
VOCABULARY = 256  # bytes
HELD_OUT_FACTOR = 4  # a held-out split takes files until it holds this many times the bytes its windows need
HELD_OUT_MIN_FILES = 8  # ... and at least this many files, so one large file cannot be a whole split
# separate numpy streams for the window draws, so no two purposes ever share random numbers
STREAM_WINDOWS = {"development": 1, "selection": 2, "retention": 3}
STREAM_PARENT = 11
STREAM_TRAIN = 12
EVAL_CHUNK = 64  # windows per forward pass in ``evaluate``

PackageName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class PyLMConfig(TaskConfig):
    layers: Annotated[int, Field(ge=1, le=24)] = 2
    width: Annotated[int, Field(ge=8, le=2048)] = 64
    heads: Annotated[int, Field(ge=1, le=64)] = 4
    context: Annotated[int, Field(ge=4, le=2048)] = 64
    parent_updates: Annotated[int, Field(ge=1, le=100_000)] = 300
    parent_lr: Annotated[float, Field(gt=0)] = 3e-3
    parent_batch: Annotated[int, Field(ge=1, le=4096)] = 16
    parent_packages: Annotated[list[PackageName], Field(min_length=1)] = ["email", "json", "http", "urllib", "xml"]
    adapt_packages: Annotated[list[PackageName], Field(min_length=1)] = ["asyncio", "concurrent", "multiprocessing"]
    eval_windows: Annotated[int, Field(ge=1, le=4096)] = 64
    train_bytes: Annotated[int, Field(ge=1024, le=50_000_000)] = 300_000

    @model_validator(mode="after")
    def _consistent(self) -> PyLMConfig:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} must be a multiple of heads {self.heads}")
        shared = sorted(set(self.parent_packages) & set(self.adapt_packages))
        if shared:
            raise ValueError(f"parent_packages and adapt_packages must not share packages ({', '.join(shared)})")
        for name, packages in (("parent_packages", self.parent_packages), ("adapt_packages", self.adapt_packages)):
            if len(set(packages)) != len(packages):
                raise ValueError(f"{name} lists a package twice")
        return self


# -- the model ---------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP, each on a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp_in = nn.Linear(width, 4 * width)
        self.mlp_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head width)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.norm2(x))))


class ByteTransformer(nn.Module):
    """Bytes in, next-byte logits out: byte and learned position embeddings, the blocks, a final norm, a head."""

    def __init__(self, layers: int, width: int, heads: int, context: int):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCABULARY, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"the model reads at most {self.context} bytes at once, not {length}")
        x = self.embed(tokens) + self.position.weight[:length]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _meta_model(config: PyLMConfig) -> ByteTransformer:
    with torch.device("meta"):  # no storage and no random draws: the global RNG is never advanced
        return ByteTransformer(config.layers, config.width, config.heads, config.context)


def build_model(config: PyLMConfig, seed: int | None, device: str = "cpu"):
    """A ``ByteTransformer``; with a seed, initialised from ``torch.Generator(seed)``, else left uninitialised.

    The modules are created on the meta device, so building never draws from (or advances) the global RNG.
    """
    model = _meta_model(config).to_empty(device="cpu")
    if seed is not None:
        generator = torch.Generator().manual_seed(int(seed))
        residual_std = 0.02 / math.sqrt(2 * config.layers)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                module_name, _, kind = name.rpartition(".")
                if kind == "bias":
                    parameter.zero_()
                elif module_name.rpartition(".")[2].startswith("norm"):
                    parameter.fill_(1.0)
                else:
                    std = residual_std if module_name.endswith(("proj", "mlp_out")) else 0.02
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    return model.to(device)


def expected_shapes(config: PyLMConfig) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in _meta_model(config).state_dict().items()}


# -- the text ----------------------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_package_files(root: Path, package: str) -> list[str]:
    """The ``.py`` files of one stdlib package (or single module), as sorted paths relative to ``root``."""
    folder = root / package
    if folder.is_dir():
        found = [path.relative_to(root).as_posix() for path in folder.rglob("*.py")
                 if path.is_file() and not SKIP_FOLDERS.intersection(path.relative_to(root).parts[:-1])]
        return sorted(found)
    if (root / f"{package}.py").is_file():
        return [f"{package}.py"]
    raise BadInput(f"the standard library at {root} has no package or module {package!r}; "
                   f"choose packages that exist in this Python ({platform.python_version()})")


def split_key(relative: str) -> str:
    return hashlib.sha256(f"{SPLIT_SALT}:{relative}".encode()).hexdigest()


def read_texts(root: Path, packages: tuple[str, ...]) -> list[tuple[str, bytes]]:
    """Every file of the packages, in split-key order (a fixed shuffle that does not depend on the listing)."""
    relatives = sorted({rel for package in packages for rel in stdlib_package_files(root, package)}, key=split_key)
    texts = [(rel, (root / rel).read_bytes()) for rel in relatives]
    return [(rel, text) for rel, text in texts if text]


def hold_out(texts: list[tuple[str, bytes]], span: int, count: int, what: str) -> tuple[list, list]:
    """Take whole files from the front until they hold enough windows; returns (held out, rest).

    Enough means ``HELD_OUT_FACTOR`` times the bytes of ``count`` windows, in at least ``HELD_OUT_MIN_FILES``
    files that hold a window each (a tiny ``__init__.py`` does not count).
    """
    target = HELD_OUT_FACTOR * count * span
    taken, size, useful = 0, 0, 0
    while taken < len(texts) and (size < target or useful < HELD_OUT_MIN_FILES):
        size += len(texts[taken][1])
        useful += len(texts[taken][1]) >= span
        taken += 1
    if size < 2 * count * span or taken >= len(texts):
        raise BadInput(f"the packages for {what} hold too little text ({sum(len(t) for _, t in texts)} bytes in "
                       f"{len(texts)} files) for its held-out windows and a training share; add packages or "
                       f"lower eval_windows or context")
    return texts[:taken], texts[taken:]


def concatenate(texts: list[tuple[str, bytes]]) -> tuple[np.ndarray, np.ndarray]:
    """One uint8 stream and its file boundaries (``bounds[i]:bounds[i+1]`` is file ``i``)."""
    stream = np.frombuffer(b"".join(text for _, text in texts), dtype=np.uint8).copy()
    bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    bounds[1:] = np.cumsum([len(text) for _, text in texts])
    return stream, bounds


def window_starts(bounds: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Per file, how many windows of ``span`` bytes fit inside it, and their cumulative count (for drawing)."""
    fits = np.maximum(np.diff(bounds) - span + 1, 0)
    return fits, np.cumsum(fits)


def draw_starts(bounds: np.ndarray, span: int, rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` window starts, uniform over every position where a window fits inside one file."""
    fits, cumulative = window_starts(bounds, span)
    total = int(cumulative[-1]) if len(cumulative) else 0
    if total == 0:
        raise BadInput(f"the training text holds no file of {span} bytes or more; lower the context")
    picks = rng.integers(0, total, size=count, dtype=np.int64)
    files = np.searchsorted(cumulative, picks, side="right")
    return bounds[files] + picks - (cumulative[files] - fits[files])


def eval_windows(texts: list[tuple[str, bytes]], span: int, count: int, stream_id: int) -> dict[str, np.ndarray]:
    """A fixed set of ``count`` non-overlapping windows, each inside one file, spread evenly over the files.

    Each file is cut into whole slots of ``span`` bytes, its slots are shuffled with a fixed generator, and the
    windows are dealt round-robin (one slot of every file, then a second of every file, ...), so a long file
    cannot fill a split on its own.
    """
    stream, bounds = concatenate(texts)
    rng = np.random.default_rng([SPLIT_SEED, stream_id])
    orders = [bounds[i] + span * rng.permutation(int(n)) for i, n in enumerate(np.diff(bounds) // span)]
    if sum(len(order) for order in orders) < count:
        raise BadInput(f"the held-out files hold only {sum(len(o) for o in orders)} windows of {span} bytes, not "
                       f"{count}; lower eval_windows or context")
    dealt: list[tuple[int, int]] = []
    for depth in range(max(len(order) for order in orders)):
        dealt.extend((int(order[depth]), index) for index, order in enumerate(orders) if depth < len(order))
        if len(dealt) >= count:
            break
    dealt = sorted(dealt[:count])
    starts = np.array([start for start, _ in dealt], dtype=np.int64)
    return {
        "windows": stream[starts[:, None] + np.arange(span)],
        "ids": starts,
        "file": np.array([index for _, index in dealt], dtype=np.int32),
        "files": np.array([rel for rel, _ in texts]),
    }


def gather(stream: np.ndarray, starts: np.ndarray, span: int, device: str):
    windows = torch.from_numpy(stream[starts[:, None] + np.arange(span)].astype(np.int64)).to(device)
    return windows[:, :-1], windows[:, 1:]


def parent_lr(peak: float, update: int, updates: int) -> float:
    """The parent's schedule: a short linear warmup, then a cosine from ``peak`` down to a tenth of it.

    A short run gains most from ending at a low rate, and the parent's budget is short by design.
    """
    warmup = max(1, min(50, updates // 10))
    if update < warmup:
        return peak * (update + 1) / warmup
    progress = (update - warmup) / max(1, updates - warmup)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


class PyLMSampler(Sampler):
    """Batches of ``batch_size`` random windows; batch ``n`` is drawn from ``(seed, n)``, so the state is ``n``."""

    fresh_ids = True  # each batch's ids are the new array of its windows' starts

    def __init__(self, train: dict[str, Any], seed: int, batch_size: int, context: int, device: str):
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.span = context + 1
        self.device = device
        self.text = train["text"]
        self.bounds = train["bounds"]
        if int(window_starts(self.bounds, self.span)[1][-1]) == 0:
            raise BadInput(f"the training text holds no file of {self.span} bytes or more; lower the context")
        self.batches = 0

    def next_batch(self) -> Batch:
        rng = np.random.default_rng([self.seed, STREAM_TRAIN, self.batches])
        starts = draw_starts(self.bounds, self.span, rng, self.batch_size)
        inputs, targets = gather(self.text, starts, self.span, self.device)
        self.batches += 1
        return Batch(ids=starts, inputs=inputs, targets=targets)

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        batches = state.get("batches") if isinstance(state, dict) else None
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise BadInput(f"the pylm sampler state must be {{'batches': a count}}, not {state!r}")
        self.batches = batches


class PyLM(Task):
    name = "pylm"
    Config = PyLMConfig
    metrics = {"correct": "higher", "total": "count", "loss": "lower", "bits_per_byte": "lower"}
    splits = ("train", "development", "selection", "retention")

    # -- built-in data ---------------------------------------------------------------------------------------
    def prepare(self, folder: Path, seeds: list[int]) -> dict[str, Any]:
        config = self.config
        folder = Path(folder)
        root = stdlib_root()
        span = config.context + 1
        data_folder = Path("data") / "pylm"
        parent_folder = Path("parents") / "pylm"

        adapt = read_texts(root, config.adapt_packages)
        selection, rest = hold_out(adapt, span, config.eval_windows, "adapt_packages (selection)")
        development, rest = hold_out(rest, span, config.eval_windows, "adapt_packages (development)")
        parent_texts = read_texts(root, config.parent_packages)
        retention, parent_train = hold_out(parent_texts, span, config.eval_windows, "parent_packages (retention)")

        paths = {"train": data_folder / "train.npz"}
        train = self._capped(rest, config.train_bytes)
        text, bounds = concatenate(train)
        write_arrays(folder / paths["train"], {"text": text, "bounds": bounds,
                                               "files": np.array([rel for rel, _ in train])})
        for split, texts in (("development", development), ("selection", selection), ("retention", retention)):
            paths[split] = data_folder / f"{split}.npz"
            write_arrays(folder / paths[split], eval_windows(texts, span, config.eval_windows, STREAM_WINDOWS[split]))

        parent_text, parent_bounds = concatenate(parent_train)
        for seed in seeds:
            state = self._train_parent(parent_text, parent_bounds, seed)
            checkpoints.save(folder / parent_folder / f"seed-{seed}.pt", state, kind="parent",
                             meta={"task": "pylm", "seed": int(seed), "packages": list(config.parent_packages),
                                   "updates": config.parent_updates, "bytes": int(len(parent_text)),
                                   "python": platform.python_version()})
        return {"data": {k: str(v) for k, v in paths.items()}, "parents": str(parent_folder / "seed-{seed}.pt")}

    @staticmethod
    def _capped(texts: list[tuple[str, bytes]], limit: int) -> list[tuple[str, bytes]]:
        """Whole files in split-key order until ``limit`` bytes; the last one is cut to fit."""
        kept, size = [], 0
        for rel, text in texts:
            if size >= limit:
                break
            kept.append((rel, text[:limit - size]))
            size += len(kept[-1][1])
        return kept

    def _train_parent(self, text: np.ndarray, bounds: np.ndarray, seed: int) -> dict:
        config = self.config
        span = config.context + 1
        with torch_threads(1):
            model = build_model(config, seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=config.parent_lr)
            for update in range(config.parent_updates):
                for group in optimizer.param_groups:
                    group["lr"] = parent_lr(config.parent_lr, update, config.parent_updates)
                rng = np.random.default_rng([int(seed), STREAM_PARENT, update])
                inputs, targets = gather(text, draw_starts(bounds, span, rng, config.parent_batch), span, "cpu")
                loss = F.cross_entropy(model(inputs).reshape(-1, VOCABULARY), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        return model.state_dict()

    # -- the interface the driver uses -------------------------------------------------------------------
    def load(self, data_paths: dict[str, Path]) -> dict[str, Any]:
        span = self.config.context + 1
        splits = {}
        for split, path in data_paths.items():
            path = Path(path)
            if split == "train":
                arrays = read_arrays(path, ("text", "bounds"))
                text, bounds = arrays["text"], arrays["bounds"]
                if (text.dtype != np.uint8 or text.ndim != 1 or bounds.ndim != 1 or len(bounds) < 2
                        or bounds[0] != 0 or bounds[-1] != len(text) or np.any(np.diff(bounds) < 0)):
                    raise BadInput(f"data file {path} is not a pylm training stream (uint8 text and its file bounds)")
            else:
                arrays = read_arrays(path, ("windows", "ids"))
                windows, ids = arrays["windows"], arrays["ids"]
                if windows.dtype != np.uint8 or windows.ndim != 2 or ids.shape != (len(windows),):
                    raise BadInput(f"data file {path} is not a pylm evaluation split (uint8 windows and their ids)")
                if windows.shape[1] != span:
                    raise BadInput(f"data file {path} holds windows of {windows.shape[1]} bytes, but context "
                                   f"{self.config.context} needs {span}; it was prepared for another context")
            splits[split] = arrays
        return splits

    def build(self, parent_path: Path | None, arm_config: dict, seed: int, device: str = "cpu") -> Built:
        return model_from_parent(build_model, self.config, expected_shapes(self.config), parent_path, seed, device)

    def sampler(self, train: Any, seed: int, batch_size: int, device: str = "cpu") -> Sampler:
        return PyLMSampler(train, seed, batch_size, self.config.context, device)

    def loss(self, model: Any, batch: Batch) -> tuple[Any, dict]:
        logits = model(batch.inputs)
        return F.cross_entropy(logits.reshape(-1, VOCABULARY), batch.targets.reshape(-1)), {}

    def evaluate(self, model: Any, rows: Any) -> dict[str, float | int]:
        device = next(model.parameters()).device
        windows = rows["windows"]
        if windows.ndim != 2 or windows.shape[1] != self.config.context + 1:
            raise BadInput(f"evaluation windows of shape {tuple(windows.shape)} do not fit context "
                           f"{self.config.context}")
        loss_sum, correct = 0.0, 0
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for first in range(0, len(windows), EVAL_CHUNK):
                    chunk = torch.from_numpy(windows[first:first + EVAL_CHUNK].astype(np.int64)).to(device)
                    inputs, targets = chunk[:, :-1], chunk[:, 1:]
                    logits = model(inputs)
                    loss_sum += float(F.cross_entropy(logits.reshape(-1, VOCABULARY), targets.reshape(-1),
                                                      reduction="sum").item())
                    correct += int((logits.argmax(dim=-1) == targets).sum().item())
        finally:
            model.train(was_training)
        total = int(windows.shape[0] * (windows.shape[1] - 1))
        loss = loss_sum / max(1, total)
        return {"correct": correct, "total": total, "loss": loss, "bits_per_byte": loss / math.log(2)}
