"""fa4-jax (FlashAttention-4's CuTe kernels called from JAX) as a benchmark contender.

``fa4_jax.flash_attn`` and ``flash_attn_varlen`` run FA4's sm90 forward and backward; the
wheels travel to the GPU machine as ``../shared/gpu/README.md`` says. Where fa4-jax does not
import, its rows say so (``row["skipped"]``) and nothing is timed.

How ejk's arguments map (`entry`):

- ``causal`` -> ``causal``. fa4-jax aligns causal bottom-right and ejk top-left; they
  agree where ``T == S``, the only shapes the benchmarks time.
- ``sliding_window=(left, right)`` -> ``window_size=(left, right)`` (keys ``i - left`` to
  ``i + right``, as ejk's).
- packed documents (``cu_seqlens``) -> ``flash_attn_varlen`` on ``[T, N, H]`` with the same
  offsets for queries and keys.
- ``logits_soft_cap``: fa4-jax has none (FA4's PyTorch interface does), so such rows are
  skipped with that reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load() -> tuple[Any | None, str]:
    """``(fa4_jax, "")``, or ``(None, why)`` where it does not import."""
    try:
        return importlib.import_module("fa4_jax"), ""
    except Exception as exc:  # not carried to this machine, or its CUDA library is missing
        return None, f"fa4-jax unavailable: {type(exc).__name__}: {str(exc)[:200]}"


def call(
    *, causal: bool = False, sliding_window: Any = None, packed: bool = False
) -> tuple[Callable[..., Any] | None, str]:
    """``(fn, "")`` calling fa4-jax as ejk is called with these arguments, ``fn(q, k, v)``
    (``fn(q, k, v, cu_seqlens)`` when ``packed``), or ``(None, why)``."""
    module, why = load()
    if module is None:
        return None, why
    window = None if sliding_window is None else tuple(sliding_window)
    if not packed:
        return (lambda q, k, v: module.flash_attn(q, k, v, causal=causal, window_size=window)), ""

    def varlen(q, k, v, cu_seqlens):
        out = module.flash_attn_varlen(
            q[0], k[0], v[0], cu_seqlens, cu_seqlens, causal=causal, window_size=window
        )
        return out[None]

    return varlen, ""


def entry(row: dict, args: tuple, side: tuple = (), **ejk_kwargs: Any) -> tuple:
    """A benchmark entry ``(row, fn, args[, side])`` of fa4-jax for the call ejk makes with
    ``ejk_kwargs`` (``causal``, ``sliding_window``, ``logits_soft_cap``; ``side``: the
    ``cu_seqlens`` of packed documents); a case it cannot express is skipped, saying why."""
    fields = {**row, "impl": "fa4-jax"}
    if ejk_kwargs.pop("logits_soft_cap", None) is not None:
        fields["skipped"] = "not served: fa4-jax has no logits soft cap"
        return fields, None, args
    fn, why = call(packed=bool(side), **ejk_kwargs)
    if why:
        fields["skipped"] = why
    return (fields, fn, args, side) if side else (fields, fn, args)
