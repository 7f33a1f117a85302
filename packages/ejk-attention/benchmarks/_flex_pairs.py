"""The (query, key) pairs a causal document mask lets through, the FLOP count of the flex
benchmarks (`bench_flex.py` in JAX, `bench_flex_torch.py` in PyTorch's process): NumPy only."""

from __future__ import annotations

import numpy as np


def visible_pairs(ids: np.ndarray, left: int | None = None) -> int:
    """Visible (query, key) pairs of causal documents ``ids`` (sorted), within ``left`` keys."""
    ids = np.asarray(ids)
    pos = np.arange(ids.size)
    starts = np.searchsorted(ids, ids, side="left")  # each token's document start
    seen = pos - starts + 1
    return int(seen.sum() if left is None else np.minimum(seen, left + 1).sum())
