"""`flex_attention`: attention with a user's score_mod and a `BlockMask`, PyTorch FlexAttention's
meaning, validated once (`flex._request`) and run on the flex part of the first backend
(`_backends.BACKENDS[name].flex`) that serves it. Here, not in `flex`, because `_backends`
imports the flex backends."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax import Array
from jaxtyping import Float

from ._backends import (
    IMPLEMENTATIONS,
    flex_backends,
    flex_order,
    platform_of,
    resolve_implementation,
    run_first,
)
from .flex._block_mask import BlockMask
from .flex._request import FlexRequest, validate_flex

__all__ = ["FLEX_IMPLEMENTATIONS", "flex_attention", "run_flex"]

# The names ``implementation=`` takes: every backend's (one without a flex part refuses
# with its ``absent`` reason).
FLEX_IMPLEMENTATIONS: tuple[str, ...] = IMPLEMENTATIONS

AnyArray = Array | np.ndarray


def flex_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    score_mod: Callable[..., Any] | None = None,
    block_mask: BlockMask | None = None,
    *,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
    bwd_config: Any = None,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B N T"]]:
    """Multi-head attention with a user's score modification and mask (FlexAttention).

    For each batch row ``b``, query head ``h``, query ``i`` and key ``j``:
    ``s = softmax_scale · q[b, i, h]·k[b, j, h // (N // K)]``, then
    ``s = score_mod(s, b, h, i, j)``, then ``s = -inf`` where
    ``block_mask.mask_mod(b, h, i, j)`` is False, and a softmax over the keys. A row with
    no visible key outputs zeros and gets zero gradients, never NaN. Gradients flow to
    q, k, v and to every float array the mods capture (a learnable bias table, ALiBi
    slopes); integer captures (document ids, lengths) get none.

    Args:
        q: queries ``[B, T, N, H]``.
        k: keys ``[B, S, K, H]`` with ``N % K == 0`` (GQA/MQA).
        v: values ``[B, S, K, Hv]``, same dtype as q and k.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on a float32 score and
            int32 indices; it may capture arrays. None: the scores as they are.
        block_mask: from `create_block_mask` with this call's ``(B, N, T, S)`` (``B``/``N``
            may be None); None: every key visible.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        return_lse: also return the float32 log-sum-exp ``[B, N, T]`` (``-inf`` on emptied rows).
        implementation: None (the platform's order: ``triton`` then ``xla`` on GPUs,
            ``pallas`` then ``xla`` on TPU, ``xla`` elsewhere), ``"xla"``, ``"triton"``
            (``ejk_kernels_gpu``'s flex kernels with both mods translated into them,
            Triton's interpreter off GPU; block sizes powers of two in [16, 256]; a mod it
            cannot translate is refused, naming the primitive; ejk's own masks
            (`causal_mask`, `sliding_window_mask`, `document_mask`, `and_masks` of them)
            without a score_mod or a config run on its built-in kernels, the same call as
            `flash_attention` with ``causal``/``sliding_window``/``segment_ids``),
            ``"pallas"`` (the TPU block-sparse kernels, Pallas' interpreter off TPU;
            mask_mods only, ``Hv == H``), or a sequence of names tried in order.
        config: a kernel config for backends that take one (``triton``: an
            ``ejk_kernels_gpu.flex.FlexConfig``, the forward's tiles and warps; ``pallas``: an
            ``ejk_kernels_tpu.BlockSparseConfig``, forward and backward blocks in one; ``xla``
            has none); default: the executor's choice (a config ``ejk tune`` or autotuning
            stored for these shapes, else the kernel's heuristic).
        bwd_config: the backward kernels' config, chosen the same way (``triton``: a
            ``FlexConfig`` whose tiles divide both block sides; ``pallas``: pass ``config``
            alone).

    Returns:
        ``out [B, T, N, Hv]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.

    Raises:
        ValueError, TypeError: a bad argument or mod (the message names it), or a config
            the kernel cannot take (``config``/``bwd_config`` named).
        NotImplementedError: no requested implementation can serve the call (each reason given).
    """
    request = validate_flex(
        q, k, v, score_mod, block_mask, softmax_scale=softmax_scale, return_lse=return_lse
    )
    return run_flex(request, implementation, config, bwd_config)


def run_flex(request: FlexRequest, implementation: Any, config: Any, bwd_config: Any) -> Any:
    """``request`` on the flex part (`_backends.flex_backends`) of the first backend of
    ``implementation`` (None: `_backends.flex_order`) that serves it.

    Raises:
        ValueError, TypeError: an unknown or malformed ``implementation``.
        NotImplementedError: none of the named backends can serve the call (each reason given).
    """
    names = resolve_implementation(implementation, FLEX_IMPLEMENTATIONS)
    if names is None:
        names = flex_order(platform_of(request))
    return run_first(request, names, config, bwd_config, backends=flex_backends())[1]
