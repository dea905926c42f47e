"""Roles of parameters, guessed from their names and shapes, so an analysis can speak of "the embedding" or
"the attention matrices" rather than of 40 tensors. The guess only groups measurements; nothing depends on it."""

from __future__ import annotations

ROLE_WORDS = (
    ("embedding", ("emb", "wte", "wpe", "token", "position")),
    ("norm", ("norm", "ln", "layernorm", "bn")),
    ("attention", ("attn", "attention", "qkv", "query", "key", "value")),
    ("mlp", ("mlp", "ffn", "fc", "feed")),
    ("head", ("head", "classifier", "output", "out_proj", "logits")),
)


def role_of(name: str, shape: tuple[int, ...]) -> str:
    lowered = name.lower()
    if lowered.endswith("bias"):
        return "bias"
    for role, words in ROLE_WORDS:
        if any(word in part for part in lowered.replace("_", ".").split(".") for word in words):
            return role
    return "matrix" if len(shape) >= 2 else "norm"
