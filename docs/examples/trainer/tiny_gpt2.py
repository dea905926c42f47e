"""What the Trainer script and the task module share: a tiny GPT-2 built from its config (no download) and a
synthetic corpus it can learn (each row counts up by its own stride, modulo the vocabulary, with a tenth of the
tokens replaced by noise)."""

from __future__ import annotations

import numpy as np

VOCAB, LENGTH = 64, 16


def make_model():
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def corpus(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(rows, 1))
    stride = rng.integers(1, 8, size=(rows, 1))
    tokens = (start + stride * np.arange(LENGTH)) % VOCAB
    noise = rng.random((rows, LENGTH)) < 0.1
    return np.where(noise, rng.integers(0, VOCAB, size=(rows, LENGTH)), tokens).astype(np.int64)
