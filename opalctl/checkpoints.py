"""Checkpoint files that can be trusted: every tensor carries a digest, and loading checks all of them.

A checkpoint is a ``torch.save`` of plain containers (dicts, lists, numbers, strings, tensors), so it loads
with ``weights_only=True``: opening one never runs code. Loading refuses a file that is larger than the stated
limit, truncated, altered (a tensor whose bytes no longer match its digest), non-finite, or whose tensors do not
have the shapes the caller expects. Each refusal is a sentence naming the file.

``model_sha256`` is one digest over every tensor's name, dtype, shape and bytes, in name order: two models with
the same ``model_sha256`` are the same model, bit for bit, whatever file they came from.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opalctl import files
from opalctl.errors import OpalctlError
from opalctl.files import NotAPlainFile, atomic_write_bytes

FORMAT = "opalctl-checkpoint/1"
DEFAULT_LIMIT_BYTES = 2 << 30


class CheckpointRefused(OpalctlError):
    """A checkpoint file that must not be used."""


def _buffer(tensor):
    """The tensor's bytes in logical order, as a numpy view (hashing it copies nothing more)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    import torch

    return flat.view(torch.uint8).numpy()


def tensor_bytes(tensor) -> bytes:
    return _buffer(tensor).tobytes()


def tensor_sha256(tensor) -> str:
    digest = hashlib.sha256()
    digest.update(str(tensor.dtype).encode())
    digest.update(repr(tuple(tensor.shape)).encode())
    digest.update(_buffer(tensor))
    return digest.hexdigest()


def model_sha256(tensors: dict[str, Any]) -> str:
    """One digest over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(name.encode())
        digest.update(b"\0")
        digest.update(str(tensor.dtype).encode())
        digest.update(repr(tuple(tensor.shape)).encode())
        digest.update(_buffer(tensor))
    return digest.hexdigest()


def describe_tensors(tensors: dict[str, Any]) -> list[dict]:
    return [
        {"name": name, "shape": list(tensors[name].shape), "dtype": str(tensors[name].dtype).replace("torch.", ""),
         "sha256": tensor_sha256(tensors[name])}
        for name in sorted(tensors)
    ]


def _collect_tensors(value: Any, prefix: str, out: dict[str, Any]) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect_tensors(item, f"{prefix}/{key}" if prefix else str(key), out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _collect_tensors(item, f"{prefix}/{index}" if prefix else str(index), out)


def skeleton_sha256(payload: dict[str, Any], known: dict[int, str] | None = None) -> str:
    """A digest of everything in a checkpoint but the tensors' bytes (keys, kinds, metadata, numbers), with each
    tensor standing in as its own digest: one flipped byte in a key or a number is caught, not only in a tensor.
    ``known`` maps ``id(tensor)`` to digests already computed (so that saving hashes each tensor once)."""
    import torch

    known = known or {}

    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            digest = known.get(id(value))
            return f"tensor:{digest if digest is not None else tensor_sha256(value)}"
        if isinstance(value, dict):
            return {f"{type(k).__name__}:{k}": plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, float) and value != value:
            return "float:nan"
        if isinstance(value, float) and value in (float("inf"), float("-inf")):
            return f"float:{value}"
        return value

    body = {key: plain(value) for key, value in payload.items() if key != "skeleton_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=repr).encode()).hexdigest()


def encode(model_state: dict[str, Any], *, kind: str, extra: dict[str, Any] | None = None,
           meta: dict[str, Any] | None = None) -> bytes:
    """Serialise a model state (and optional extra state: optimizer, sampler, RNG) with digests of every tensor."""
    return _encode(model_state, kind=kind, extra=extra, meta=meta)[0]


def _view_key(tensor) -> tuple:
    """Equal for two tensors that are the same view of the same memory (a tied weight under two names)."""
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype)


def cpu_copies(model_state: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of each tensor, owning its memory, with tied tensors (one parameter under several names, as an
    output layer sharing the embedding's weight) copied once and shared again: ``torch.save`` then stores their
    bytes once, and ``load`` gives back names that share memory. The digests are per name, so a checkpoint of a
    tied model has the same ``model_sha256`` and the same record layout as before; older files read as ever."""
    copies: dict[tuple, Any] = {}
    out = {}
    for name, tensor in model_state.items():
        tensor = tensor.detach()
        key = _view_key(tensor)
        if key not in copies:
            copies[key] = tensor.to("cpu").clone()
        out[name] = copies[key]
    return out


def _encode(model_state: dict[str, Any], *, kind: str, extra: dict[str, Any] | None,
            meta: dict[str, Any] | None) -> tuple[bytes, str]:
    import torch

    model_state = cpu_copies(model_state)
    extra = extra or {}
    extra_tensors: dict[str, Any] = {}
    _collect_tensors(extra, "", extra_tensors)
    digests = {name: tensor_sha256(tensor) for name, tensor in model_state.items()}
    extra_digests = {name: tensor_sha256(tensor) for name, tensor in extra_tensors.items()}
    known = {id(model_state[name]): digest for name, digest in digests.items()}
    known.update({id(extra_tensors[name]): digest for name, digest in extra_digests.items()})
    payload = {
        "format": FORMAT,
        "kind": kind,
        "model": model_state,
        "model_sha256": model_sha256(model_state),
        "digests": digests,
        "extra": extra,
        "extra_digests": extra_digests,
        "meta": meta or {},
    }
    payload["skeleton_sha256"] = skeleton_sha256(payload, known)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue(), payload["model_sha256"]


def save(path: str | os.PathLike, model_state: dict[str, Any], *, kind: str, extra: dict[str, Any] | None = None,
         meta: dict[str, Any] | None = None, before_replace: Callable[[], object] | None = None) -> dict[str, Any]:
    """Write a checkpoint atomically; returns ``{path, bytes, sha256, model_sha256}``. ``before_replace``: as in
    ``atomic_write_bytes``."""
    data, model_digest = _encode(model_state, kind=kind, extra=extra, meta=meta)
    atomic_write_bytes(path, data, before_replace=before_replace)
    return {"path": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "model_sha256": model_digest}


def load(path: str | os.PathLike, *, limit_bytes: int = DEFAULT_LIMIT_BYTES,
         expected_shapes: dict[str, tuple[int, ...]] | None = None, require_finite: bool = True) -> dict[str, Any]:
    """Load and check a checkpoint; returns the payload (``model``, ``extra``, ``meta``, ``model_sha256``...)."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointRefused(f"checkpoint {path} does not exist")
    size = path.stat().st_size
    if size > limit_bytes:
        raise CheckpointRefused(
            f"checkpoint {path} is {size} bytes, over the limit of {limit_bytes}; raise the limit only if you "
            f"trust the file")
    payload = _torch_load(path, lambda: torch.load(path, map_location="cpu", weights_only=True))
    return _checked(payload, path, expected_shapes, require_finite)


def read_beneath(root: str | os.PathLike, relative: str, *, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> bytes:
    """A checkpoint's bytes as a process that trusts no path of the folder's writer reads them
    (``files.read_beneath``: no link followed, one regular file within the limit); refused in one sentence."""
    path = Path(root) / relative
    try:
        return files.read_beneath(root, relative, limit_bytes)
    except FileNotFoundError:
        raise CheckpointRefused(f"checkpoint {path} does not exist") from None
    except NotAPlainFile as error:
        raise CheckpointRefused(f"checkpoint {path} is refused: {error}; only a regular file the run wrote is "
                                f"read") from None


def load_bytes(data: bytes, path: str | os.PathLike, *, expected_shapes: dict[str, tuple[int, ...]] | None = None,
               require_finite: bool = True) -> dict[str, Any]:
    """``load`` of a checkpoint's bytes already read (``read_beneath``); ``path`` names it in a refusal."""
    import torch

    payload = _torch_load(path, lambda: torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
    return _checked(payload, Path(path), expected_shapes, require_finite)


def _torch_load(path, load: Callable[[], Any]) -> Any:
    try:
        return load()
    except Exception as error:  # torch raises several types for damaged archives
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointRefused(
            f"checkpoint {path} cannot be read (truncated or damaged: {first_line[:160]})") from None


def _checked(payload: Any, path: Path, expected_shapes: dict[str, tuple[int, ...]] | None,
             require_finite: bool) -> dict[str, Any]:
    """The payload of a checkpoint loaded from ``path``, every digest and shape checked."""
    import torch

    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointRefused(f"checkpoint {path} is not an opalctl checkpoint ({FORMAT})")
    model = payload.get("model")
    digests = payload.get("digests")
    if not isinstance(model, dict) or not isinstance(digests, dict) or set(model) != set(digests):
        raise CheckpointRefused(f"checkpoint {path} lists tensors without digests; it was altered")
    for name, tensor in model.items():
        if tensor_sha256(tensor) != digests[name]:
            raise CheckpointRefused(f"checkpoint {path}: tensor {name!r} does not match its digest; it was altered, "
                                    f"so restore the file from a copy you trust")
        if require_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointRefused(f"checkpoint {path}: tensor {name!r} holds NaN or infinite values")
    if model_sha256(model) != payload.get("model_sha256"):
        raise CheckpointRefused(f"checkpoint {path}: model digest does not match its tensors; it was altered")
    extra_tensors: dict[str, Any] = {}
    _collect_tensors(payload.get("extra", {}), "", extra_tensors)
    extra_digests = payload.get("extra_digests", {})
    if set(extra_tensors) != set(extra_digests):
        raise CheckpointRefused(f"checkpoint {path}: its saved state lists tensors without digests; it was altered")
    for name, tensor in extra_tensors.items():
        if tensor_sha256(tensor) != extra_digests[name]:
            raise CheckpointRefused(f"checkpoint {path}: saved state {name!r} does not match its digest")
    if payload.get("skeleton_sha256") != skeleton_sha256(payload):
        raise CheckpointRefused(f"checkpoint {path}: its keys or metadata do not match their digest; it was altered")
    if expected_shapes is not None:
        missing = sorted(set(expected_shapes) - set(model))
        unexpected = sorted(set(model) - set(expected_shapes))
        if missing or unexpected:
            raise CheckpointRefused(
                f"checkpoint {path} does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        for name, shape in expected_shapes.items():
            if tuple(model[name].shape) != tuple(shape):
                raise CheckpointRefused(
                    f"checkpoint {path}: tensor {name!r} has shape {tuple(model[name].shape)}, the model needs "
                    f"{tuple(shape)}")
    return payload
