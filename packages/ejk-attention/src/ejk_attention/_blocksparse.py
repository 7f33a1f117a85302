"""`blocksparse_attention`: attention under an `ejk_kernels_tpu` mask on any platform.

On TPU the Pallas block-sparse kernel skips the blocks the mask leaves empty; on
other platforms the ``xla`` path applies the same mask densely (``mask.dense()``),
and ``implementation="pallas"`` runs the kernel in Pallas' TPU interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import Array
from jaxtyping import Float, Int

from ejk_kernels_tpu import Mask
from ejk_sequtils import validate_attention

from ._backends import BACKENDS, platform_of, resolve_implementation, run_first

__all__ = ["blocksparse_attention"]

AnyArray = Array | np.ndarray


def _check_mask(mask: Any, heads: int, q_len: int, kv_len: int) -> None:
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be an ejk_kernels_tpu Mask, got {type(mask).__name__}")
    shape = tuple(mask.shape)
    if shape != (q_len, kv_len) and not (
        len(shape) == 3 and shape[0] in (1, heads) and shape[1:] == (q_len, kv_len)
    ):
        raise ValueError(
            f"mask shape {shape} must be ({q_len}, {kv_len}) or (1|{heads}, {q_len}, {kv_len})"
        )


def blocksparse_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    mask: Any,
    *,
    segment_ids: Int[AnyArray, "B T"]
    | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]
    | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B N T"]]:
    """Attention where query i sees key j only where ``mask`` is True (and segment ids agree).

    Args:
        q: queries ``[B, T, N, H]``.
        k: keys ``[B, S, K, H]``, ``N % K == 0``.
        v: values ``[B, S, K, Hv]`` (the Pallas kernel needs ``Hv == H``).
        mask: an `ejk_kernels_tpu` mask (``CausalMask``, ``LocalMask``, ``ChunkedCausalMask``,
            ``NumpyMask``, ``FullMask``, ``a & b``, ``a | b``) of shape ``(T, S)``, or a
            ``MultiHeadMask`` ``(1|N, T, S)``.
        segment_ids: ``[B, T]`` (T == S) or ``(q_ids [B, T], kv_ids [B, S])``; negative ids are padding.
        softmax_scale: default ``H ** -0.5``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` or ``[N, num_sinks]`` logits in the softmax denominator only.
        return_lse: also return the float32 lse ``[B, N, T]``.
        implementation: None (pallas on TPU, else xla), ``"pallas"`` (interpreted off TPU),
            ``"xla"``, or a sequence tried in order.
        config: an `ejk_kernels_tpu.BlockSparseConfig` for the Pallas kernel.

    Returns:
        ``out [B, T, N, Hv]`` in q's dtype (and the lse); rows that see no key are zeros.
    """
    request = validate_attention(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        segment_ids=segment_ids,
        return_lse=return_lse,
    )
    _, t, s, n, *_ = request.shape
    _check_mask(mask, n, t, s)
    names = resolve_implementation(implementation)
    if names is None:
        names = ("pallas", "xla") if platform_of(request) == "tpu" else ("xla",)
    # Each backend's block-sparse part (pallas first: the kernel's own order where it runs).
    parts = {name: BACKENDS[name].block_sparse(mask) for name in ("pallas", *BACKENDS)}
    backends = {name: part for name, part in parts.items() if part is not None}
    return run_first(request, names, config, backends=backends)[1]
