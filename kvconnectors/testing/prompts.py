"""Deterministic token-id prompts of exact lengths (block-boundary cases need exact control)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Keep clear of the special tokens at the start of the tiny tokenizer's vocabulary.
FIRST_ORDINARY_TOKEN = 16


def token_prompts(lengths: Sequence[int], vocab_size: int = 768, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=n).tolist() for n in lengths]


def block_edge_lengths(block_size: int) -> list[int]:
    """Prompt lengths around block boundaries: under a block, exactly one, one past, many."""
    return [block_size // 2, block_size, block_size + 1, 2 * block_size, 3 * block_size + 7,
            8 * block_size + 5]
