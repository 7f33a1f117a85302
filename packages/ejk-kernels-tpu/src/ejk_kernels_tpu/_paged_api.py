"""Ragged paged attention for serving on TPU: `paged_attention` (validates),
`paged_attention_request` (a validated request), `unsupported_paged_reason`. Forward only:
serving takes no gradients."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ejk_sequtils import PagedAttentionRequest, validate_paged_attention

from ._config import VMEM_BUDGET
from ._ops import default_interpret
from ._paged_config import (
    PagedShape,
    RaggedPagedConfig,
    effective_block_q,
    fits_paged_vmem,
    paged_shape,
    paged_vmem_bytes,
    ragged_paged_heuristic,
)
from ._paged_kernel import PagedStatic, paged_forward

__all__ = [
    "default_paged_config",
    "paged_attention",
    "paged_attention_request",
    "request_shape",
    "unsupported_paged_reason",
]

AnyArray = Array | np.ndarray
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def unsupported_paged_reason(
    request: PagedAttentionRequest, *, interpret: Any = None
) -> str | None:
    """Why the ragged paged kernel cannot serve a valid request, or None if it can.

    Args:
        request: from `ejk_sequtils.validate_paged_attention`.
        interpret: as in `paged_attention_request` (float16 compiles only in the
            interpreter); default `default_interpret()`.

    Returns:
        A sentence naming the unsupported part and its value, or None.
    """
    dtype = jnp.dtype(request.q.dtype)
    if dtype not in _DTYPES:
        return (
            "the ragged paged kernel takes float32, bfloat16 or float16 inputs, got "
            f"q.dtype={dtype}"
        )
    interpret = default_interpret() if interpret is None else interpret
    if interpret is False and dtype == jnp.float16:
        # Mosaic has no float16 matmul path (as for the block-sparse kernels).
        return "the ragged paged kernel on TPU takes float32 or bfloat16, got q.dtype=float16"
    smallest = RaggedPagedConfig(block_q=8, pages_per_block=1)
    shape = request_shape(request)
    if interpret is False and not fits_paged_vmem(smallest, shape):
        return (
            f"the ragged paged kernel's smallest blocks need {paged_vmem_bytes(smallest, shape)} "
            f"bytes of VMEM, over its budget of {VMEM_BUDGET} (heads={request.heads}, "
            f"head_dim={request.head_dim}, page_size={request.page_size})"
        )
    return None


def request_shape(request: PagedAttentionRequest) -> PagedShape:
    """The `PagedShape` of a request."""
    return paged_shape(request.q, request.k_pages, request.page_table, ragged=request.is_ragged)


def default_paged_config(request: PagedAttentionRequest) -> RaggedPagedConfig:
    """`ragged_paged_heuristic` for a request."""
    return ragged_paged_heuristic(request_shape(request))


def _row_offsets(request: PagedAttentionRequest) -> Any:
    """int32 ``[B + 1]``: sequence ``b`` owns the flattened query rows ``cu[b]:cu[b + 1]``."""
    if request.is_ragged:
        return jnp.asarray(request.cu_q_lens, jnp.int32)
    return jnp.arange(request.batch + 1, dtype=jnp.int32) * request.num_q_rows


def _block_sequences(cu: Any, blocks: int, block_q: int) -> tuple[Any, Any]:
    """``(seq_lo, seq_hi)`` int32 ``[blocks]``: block ``i`` (rows ``i * block_q`` on) has rows
    only of the sequences ``seq_lo[i] <= b < seq_hi[i]`` (those ending after its first row
    and starting before its end)."""
    first = jnp.arange(blocks, dtype=jnp.int32) * block_q
    lo = jnp.searchsorted(cu[1:], first, side="right", method="compare_all")
    hi = jnp.searchsorted(cu[:-1], first + block_q, side="left", method="compare_all")
    return lo.astype(jnp.int32), jnp.maximum(hi, lo).astype(jnp.int32)


def _kv_scale_kind(request: PagedAttentionRequest) -> int:
    """The kernel's ``kv_scales``: 0 (no fp8), 1 (both scales scalars), 2 (per token)."""
    if not request.is_quantized:
        return 0
    return 1 if request.k_scales.ndim == 0 and request.v_scales.ndim == 0 else 2


def _kernel_scales(request: PagedAttentionRequest, kind: int) -> tuple[Any, Any]:
    """``(k_scales, v_scales)`` as the kernel takes them: None, scalars, or both
    ``[P, page_size, K]`` (a scalar one broadcast) for ``kind`` 0, 1, 2."""
    if kind == 0:
        return None, None
    shape = request.k_pages.shape[:3]
    scales = (jnp.asarray(s, jnp.float32) for s in (request.k_scales, request.v_scales))
    return tuple(s if kind == 1 else jnp.broadcast_to(s, shape) for s in scales)


def paged_attention_request(
    request: PagedAttentionRequest,
    *,
    config: RaggedPagedConfig | None = None,
    interpret: Any = None,
) -> Float[Array, "B T N H"] | Float[Array, "total_q N H"]:
    """Paged attention of an already validated request (not checked again): the ragged
    paged kernel (`_paged_kernel`).

    Args:
        request: from `ejk_sequtils.validate_paged_attention`.
        config: block sizes; default `ragged_paged_heuristic`.
        interpret: False to compile for TPU, or `pltpu.InterpretParams`; default
            `default_interpret()` (the interpreter unless the default backend is a TPU).

    Returns:
        ``out`` shaped like ``q``, in ``q.dtype``.

    Raises:
        NotImplementedError: the request is valid but the kernel cannot serve it
            (`unsupported_paged_reason`).
        TypeError: ``config`` is not a `RaggedPagedConfig`.
    """
    interpret = default_interpret() if interpret is None else interpret
    reason = unsupported_paged_reason(request, interpret=interpret)
    if reason is not None:
        raise NotImplementedError(reason)
    if config is not None and not isinstance(config, RaggedPagedConfig):
        raise TypeError(f"config must be a RaggedPagedConfig or None, got {config!r}")
    cfg = config or default_paged_config(request)
    q = jnp.asarray(request.q)
    heads, kv_heads, head_dim = request.heads, request.kv_heads, request.head_dim
    rows = q.shape[0] if request.is_ragged else q.shape[0] * q.shape[1]
    if 0 in (rows, heads, head_dim, request.batch, request.num_pages):
        # Nothing to compute, or no page to read (every kv_len is 0): zeros.
        return jnp.zeros(q.shape, q.dtype)
    block_q = effective_block_q(cfg.block_q, q.dtype.itemsize)
    blocks = -(-rows // block_q)
    group = heads // kv_heads
    # Kernel layout [K, G, R, H]: the rows of a kv group are one tile.
    q_kernel = jnp.swapaxes(q.reshape(rows, heads, head_dim), 0, 1)
    q_kernel = jnp.pad(q_kernel, ((0, 0), (0, blocks * block_q - rows), (0, 0)))
    q_kernel = q_kernel.reshape(kv_heads, group, blocks * block_q, head_dim)
    cu = _row_offsets(request)
    seq_lo, seq_hi = _block_sequences(cu, blocks, block_q)
    window = request.sliding_window
    st = PagedStatic(
        kv_heads=kv_heads,
        group=group,
        page_size=request.page_size,
        pages_per_seq=request.pages_per_seq,
        num_pages=request.num_pages,
        block_q=block_q,
        pages_per_block=min(cfg.pages_per_block, request.pages_per_seq),
        scale=float(request.softmax_scale),
        soft_cap=request.logits_soft_cap,
        window_left=None if window is None else int(window[0]),
        has_sinks=request.softmax_sinks is not None,
        interpret=interpret,
        kv_scales=_kv_scale_kind(request),
    )
    sinks = request.softmax_sinks
    out = paged_forward(
        q_kernel,
        jnp.asarray(request.k_pages),
        jnp.asarray(request.v_pages),
        jnp.asarray(request.page_table, jnp.int32).reshape(-1),
        jnp.asarray(request.kv_lens, jnp.int32),
        cu,
        seq_lo,
        seq_hi,
        None if sinks is None else jnp.asarray(sinks, jnp.float32),
        *_kernel_scales(request, st.kv_scales),
        st=st,
    )
    out = jnp.swapaxes(out.reshape(heads, blocks * block_q, head_dim)[:, :rows], 0, 1)
    return out.reshape(q.shape)


def paged_attention(
    q: Float[AnyArray, "B T N H"] | Float[AnyArray, "total_q N H"],
    k_pages: Float[AnyArray, "P page_size K H"],
    v_pages: Float[AnyArray, "P page_size K H"],
    page_table: Int[AnyArray, "B pages_per_seq"],
    kv_lens: Int[AnyArray, " B"],
    *,
    config: RaggedPagedConfig | None = None,
    interpret: Any = None,
    **options: Any,
) -> Float[Array, "B T N H"] | Float[Array, "total_q N H"]:
    """Ragged paged attention for serving on TPU (Pallas), forward only.

    The arguments are `ejk_sequtils.validate_paged_attention`'s, which checks them and
    defines the conventions; then `paged_attention_request` runs the call.

    Args:
        q: ``[B, T, N, H]``, the last ``T`` tokens of each sequence; or ``[total_q, N, H]``
            with ``cu_q_lens`` (sequence ``b`` owns rows ``cu_q_lens[b]:cu_q_lens[b + 1]``).
        k_pages, v_pages, page_table, kv_lens: the paged cache and each sequence's length
            (its new tokens included).
        config: a `RaggedPagedConfig`; default `ragged_paged_heuristic`.
        interpret: as in `paged_attention_request`.
        **options: ``cu_q_lens``, ``softmax_scale``, ``sliding_window``,
            ``logits_soft_cap``, ``softmax_sinks``, ``k_scales``, ``v_scales`` (with
            ``float8_e4m3fn`` pages), as `validate_paged_attention` takes them.

    Returns:
        ``out`` shaped like ``q``, in ``q.dtype``.

    Raises:
        ValueError, TypeError: a bad argument (the message names it).
        NotImplementedError: what `unsupported_paged_reason` names.
    """
    request = validate_paged_attention(q, k_pages, v_pages, page_table, kv_lens, **options)
    return paged_attention_request(request, config=config, interpret=interpret)
