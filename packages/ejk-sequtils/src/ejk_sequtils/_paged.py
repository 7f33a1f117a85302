"""Paged attention (serving): the validation of a call and its float32 reference.

A serving engine keeps each sequence's keys and values in fixed-size pages of one
pool, ``k_pages``/``v_pages`` ``[P, page_size, K, H]``; ``page_table[b]`` lists the pages
of sequence ``b`` in order and ``kv_lens[b]`` its length, new tokens included. The
queries are each sequence's last tokens:

- `paged_attention` form: ``q`` ``[B, T, N, H]``, the last ``T`` tokens of every sequence;
- ragged form (``cu_q_lens``): ``q`` ``[total_q, N, H]``; sequence ``b`` owns the rows
  ``cu_q_lens[b]:cu_q_lens[b + 1]``, its last ``cu_q_lens[b + 1] - cu_q_lens[b]`` tokens
  (a batch mixing prefill chunks and decode steps).

Causal is bottom-right: a query of sequence ``b`` that is its ``t``-th of ``T_b`` new
tokens sits at position ``kv_lens[b] - T_b + t`` and sees the keys at positions ``<=`` its
own (and, with ``sliding_window=(left, right)``, ``>= position - left``). A sequence with
``kv_lens[b] == 0`` (an idle slot) and a query whose position is negative see no key and
output zeros. Page-table entries past a sequence's last page are never read, whatever
they hold, and neither are page slots past ``kv_lens[b]``.

FP8 pages: ``k_pages``/``v_pages`` in ``float8_e4m3fn`` come with float32 ``k_scales``/``v_scales``
``[P, page_size, K]`` (one per stored token and kv head) or scalars; a slot holds
``page * scale`` (`dequantize_kv`), and the queries and the output keep their own dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._kv_quant import FP8_KV_DTYPE, dequantize_kv
from ._reference import reference_attention
from ._request import (
    _array,
    _concrete,
    _float_array,
    _int_array,
    _soft_cap,
    _softmax_scale,
    _validate_cu_seqlens,
    _validate_sinks,
)
from ._visibility import _sequence_of, normalize_window, visibility_mask

__all__ = [
    "PagedAttentionRequest",
    "gather_pages",
    "paged_reference_attention",
    "paged_visibility",
    "ragged_rows",
    "validate_paged_attention",
]

AnyArray = Array | np.ndarray


@dataclasses.dataclass(frozen=True)
class PagedAttentionRequest:
    """A validated paged attention call in normal form (what a paged backend receives).

    Arrays are kept as given (jax arrays, tracers or NumPy arrays). ``cu_q_lens`` is None
    for the ``[B, T, N, H]`` form; ``softmax_sinks`` is ``[N]`` (several sinks per head
    already folded), ``sliding_window`` a ``(left, right)`` pair, ``softmax_scale`` resolved.
    """

    q: Any
    k_pages: Any
    v_pages: Any
    page_table: Any
    kv_lens: Any
    cu_q_lens: Any
    softmax_scale: float
    sliding_window: tuple[int, int] | None
    logits_soft_cap: float | None
    softmax_sinks: Any
    k_scales: Any = None
    v_scales: Any = None

    @property
    def is_ragged(self) -> bool:
        """True for the ``[total_q, N, H]`` form (``cu_q_lens`` given)."""
        return self.cu_q_lens is not None

    @property
    def is_quantized(self) -> bool:
        """True for fp8 pages with scales (`dequantize_kv`)."""
        return self.k_scales is not None

    @property
    def batch(self) -> int:
        """B, the number of sequences (rows of ``page_table``)."""
        return self.page_table.shape[0]

    @property
    def num_q_rows(self) -> int:
        """T (queries per sequence), or total_q in the ragged form."""
        return self.q.shape[0] if self.is_ragged else self.q.shape[1]

    @property
    def heads(self) -> int:
        """N, query heads."""
        return self.q.shape[-2]

    @property
    def kv_heads(self) -> int:
        """K, key/value heads (N % K == 0)."""
        return self.k_pages.shape[2]

    @property
    def head_dim(self) -> int:
        """H."""
        return self.q.shape[-1]

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.k_pages.shape[1]

    @property
    def pages_per_seq(self) -> int:
        """Columns of ``page_table``: a sequence holds at most ``pages_per_seq * page_size`` tokens."""
        return self.page_table.shape[1]

    @property
    def num_pages(self) -> int:
        """P, pages in the pool."""
        return self.k_pages.shape[0]

    @property
    def capacity(self) -> int:
        """``pages_per_seq * page_size``, the longest sequence the table can hold."""
        return self.pages_per_seq * self.page_size

    def features(self) -> frozenset[str]:
        """Names of the optional features this request uses (for capability checks)."""
        used = {
            "ragged": self.is_ragged,
            "sliding_window": self.sliding_window is not None,
            "logits_soft_cap": self.logits_soft_cap is not None,
            "softmax_sinks": self.softmax_sinks is not None,
            "fp8_kv": self.is_quantized,
        }
        return frozenset(name for name, on in used.items() if on)


_INT32 = np.dtype(np.int32)  # not jnp.int32: comparing a dtype with it runs Python code


def _int32_array(x: Any, name: str, layout: str, shape: tuple[int, ...]) -> Any:
    """``x`` as an int32 array of ``shape`` (``layout`` names its axes in messages)."""
    x = _int_array(x, name)
    if x.dtype != _INT32:
        raise TypeError(f"{name} must be int32, got {name}.dtype={x.dtype} (use .astype(int32))")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {layout}={shape}, got {name}.shape={x.shape}")
    return x


def _outside(values: np.ndarray, low: int, high: int) -> bool:
    """Some entry of ``values`` lies outside ``[low, high]``."""
    return bool(values.size > 0 and (values.min() < low or values.max() > high))


def _check_lengths(page_table: Any, kv_lens: Any, page_size: int, num_pages: int) -> None:
    """When their values are known: ``0 <= kv_lens <= capacity``, and the pages in use exist."""
    lens = _concrete(kv_lens)
    if lens is None:
        return
    capacity = page_table.shape[1] * page_size
    # Eager calls pay for these checks on every call: two reductions first, then (only for
    # bad input) the search for the entry to name.
    bad = np.flatnonzero((lens < 0) | (lens > capacity)) if _outside(lens, 0, capacity) else ()
    if len(bad):
        b = int(bad[0])
        raise ValueError(
            f"kv_lens must be in [0, pages_per_seq * page_size = {capacity}], got "
            f"kv_lens[{b}]={int(lens[b])}"
        )
    table = _concrete(page_table)
    if table is None or not _outside(table, 0, num_pages - 1):
        return
    in_use = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // page_size)
    bad = np.argwhere(in_use & ((table < 0) | (table >= num_pages)))
    if bad.size:
        b, i = (int(j) for j in bad[0])
        raise ValueError(
            f"page_table[{b}, {i}]={int(table[b, i])} is not a page of the pool [0, {num_pages}) "
            f"(sequence {b} of length kv_lens[{b}]={int(lens[b])} uses it)"
        )


def validate_paged_attention(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    page_table: Any,
    kv_lens: Any,
    *,
    cu_q_lens: Any = None,
    softmax_scale: Any = None,
    sliding_window: Any = None,
    logits_soft_cap: Any = None,
    softmax_sinks: Any = None,
    k_scales: Any = None,
    v_scales: Any = None,
) -> PagedAttentionRequest:
    """Check every argument of a paged attention call and return them in normal form.

    Args:
        q: ``[B, T, N, H]``, or ``[total_q, N, H]`` with ``cu_q_lens``.
        k_pages: ``[P, page_size, K, H]``, ``N % K == 0``, q's dtype, or ``float8_e4m3fn``
            with ``k_scales``.
        v_pages: like ``k_pages`` (the same dtype).
        page_table: int32 ``[B, pages_per_seq]``.
        kv_lens: int32 ``[B]``, each sequence's length including its new tokens.
        cu_q_lens: int32 ``[B + 1]`` (ragged form): offsets of each sequence's query rows,
            from 0 to ``total_q``.
        softmax_scale, sliding_window, logits_soft_cap, softmax_sinks: as in
            `validate_attention` (causal is always on, bottom-right).
        k_scales, v_scales: with ``float8_e4m3fn`` pages (and only then), float32
            ``[P, page_size, K]`` (one scale per stored token and kv head) or a scalar (a
            float or a 0-d float32 array); a slot holds ``page * scale`` (`dequantize_kv`).

    Values are checked only when concrete (not traced inside ``jax.jit``): ``kv_lens`` in
    ``[0, pages_per_seq * page_size]``, the table's pages in use inside the pool, and
    ``cu_q_lens`` from 0, non-decreasing, ending at ``total_q``.

    Raises:
        TypeError: an argument of the wrong kind or dtype (the message names it).
        ValueError: an argument of the wrong shape or value (the message names it).
    """
    ragged = cu_q_lens is not None
    q = _float_array(q, "q")
    if q.ndim != (3 if ragged else 4):
        layout = "rank 3 [total_q, N, H] (with cu_q_lens)" if ragged else "rank 4 [B, T, N, H]"
        raise ValueError(f"q must be {layout}, got q.shape={q.shape}")
    k_pages = _page_array(k_pages, "k_pages")
    v_pages = _page_array(v_pages, "v_pages")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be rank 4 [P, page_size, K, H], got k_pages.shape={k_pages.shape}"
        )
    if v_pages.shape != k_pages.shape:
        raise ValueError(
            f"v_pages must have k_pages' shape {k_pages.shape}, got v_pages.shape={v_pages.shape}"
        )
    quantized = k_pages.dtype == FP8_KV_DTYPE
    if v_pages.dtype != k_pages.dtype or (not quantized and k_pages.dtype != q.dtype):
        raise TypeError(
            f"q, k_pages and v_pages must share one dtype (or k_pages and v_pages both "
            f"float8_e4m3fn, with scales), got q.dtype={q.dtype}, "
            f"k_pages.dtype={k_pages.dtype}, v_pages.dtype={v_pages.dtype}"
        )
    heads, head_dim = q.shape[-2:]
    num_pages, page_size, kv_heads, page_head_dim = k_pages.shape
    if page_head_dim != head_dim:
        raise ValueError(
            f"k_pages must have q's head_dim {head_dim}, got k_pages.shape={k_pages.shape}"
        )
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"q heads={heads} must be a multiple of the pages' kv heads={kv_heads} "
            f"(k_pages.shape={k_pages.shape})"
        )
    if page_size == 0:
        raise ValueError(f"k_pages must have page_size > 0, got k_pages.shape={k_pages.shape}")
    k_scales = _validate_scales(k_scales, "k_scales", k_pages, "k_pages")
    v_scales = _validate_scales(v_scales, "v_scales", v_pages, "v_pages")

    if ragged:
        cu_q_lens = _validate_cu_seqlens(cu_q_lens, "cu_q_lens", q.shape[0])
        if cu_q_lens.dtype != _INT32:
            raise TypeError(f"cu_q_lens must be int32, got cu_q_lens.dtype={cu_q_lens.dtype}")
        cu = _concrete(cu_q_lens)
        if cu is not None and cu[-1] != q.shape[0]:
            raise ValueError(
                f"cu_q_lens must end at total_q={q.shape[0]} (q.shape[0]), got "
                f"cu_q_lens[-1]={int(cu[-1])}"
            )
        batch = cu_q_lens.shape[0] - 1
    else:
        batch = q.shape[0]
    page_table = _int_array(page_table, "page_table")
    if page_table.ndim != 2:
        raise ValueError(
            f"page_table must be rank 2 [B, pages_per_seq], got page_table.shape={page_table.shape}"
        )
    page_table = _int32_array(
        page_table, "page_table", "[B, pages_per_seq]", (batch, page_table.shape[1])
    )
    kv_lens = _int32_array(kv_lens, "kv_lens", "[B]", (batch,))
    _check_lengths(page_table, kv_lens, page_size, num_pages)

    return PagedAttentionRequest(
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        page_table=page_table,
        kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        softmax_scale=_softmax_scale(softmax_scale, head_dim),
        sliding_window=normalize_window(sliding_window),
        logits_soft_cap=_soft_cap(logits_soft_cap),
        softmax_sinks=None if softmax_sinks is None else _validate_sinks(softmax_sinks, heads),
        k_scales=k_scales,
        v_scales=v_scales,
    )


def _page_array(x: Any, name: str) -> Any:
    """A pool of pages: a floating array (`_float_array`'s dtypes) or ``float8_e4m3fn``."""
    x = _array(x, name, "a floating jax or NumPy array")
    if x.dtype == FP8_KV_DTYPE:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 1:
        raise TypeError(
            f"{name} in 8 bits must be float8_e4m3fn (with scales), got {name}.dtype={x.dtype}"
        )
    return _float_array(x, name)


def _validate_scales(scales: Any, name: str, pages: Any, pages_name: str) -> Any:
    """``scales`` of fp8 ``pages``: float32 ``[P, page_size, K]`` or a scalar (a Python
    float becomes a float32 array); None for pages of any other dtype."""
    if pages.dtype != FP8_KV_DTYPE:
        if scales is not None:
            raise TypeError(
                f"{name} is only for float8_e4m3fn pages, got {name} with "
                f"{pages_name}.dtype={pages.dtype}"
            )
        return None
    shape = pages.shape[:3]
    expected = f"float32 [P, page_size, K]={shape} or a scalar"
    if scales is None:
        raise ValueError(
            f"{pages_name} of dtype float8_e4m3fn need {name} ({expected}), got {name}=None"
        )
    if isinstance(scales, float | int) and not isinstance(scales, bool):
        return jnp.asarray(scales, jnp.float32)
    scales = _array(scales, name, f"{expected}")
    if scales.dtype != jnp.float32:
        raise TypeError(f"{name} must be float32, got {name}.dtype={scales.dtype}")
    if scales.shape not in ((), shape):
        raise ValueError(
            f"{name} must have shape [P, page_size, K]={shape} or (), got {name}.shape={scales.shape}"
        )
    return scales


def gather_pages(
    pages: Float[AnyArray, "P page_size K H"],
    page_table: Int[AnyArray, "B pages_per_seq"],
    num_keys: Int[AnyArray, " B"],
    *,
    scales: Float[AnyArray, "P page_size K"] | Float[AnyArray, ""] | None = None,
) -> Float[Array, "B S K H"]:
    """Each sequence's pages laid end to end: a contiguous cache ``[B, pages_per_seq * page_size, K, H]``.

    Only the first ``num_keys[b]`` slots of row ``b`` come from the pages; the slots past
    it are zeros, and the table's entries past a sequence's last page are never read
    (whatever they hold). An entry in use that is not a page of the pool (only possible
    with traced values: `validate_paged_attention` rejects it otherwise) is clamped.
    With ``scales`` (fp8 pages) the gathered slots are dequantised (`dequantize_kv`):
    only the rows gathered, never the whole pool.

    Args:
        pages: ``[P, page_size, K, H]``.
        page_table: ``[B, pages_per_seq]`` page ids.
        num_keys: ``[B]`` tokens held by each sequence.
        scales: None, or the pages' float32 scales ``[P, page_size, K]`` or scalar.

    Returns:
        ``[B, pages_per_seq * page_size, K, H]`` in ``pages.dtype``, float32 with ``scales``.
    """
    num_pages, page_size, kv_heads, head_dim = pages.shape
    batch, pages_per_seq = page_table.shape
    capacity = pages_per_seq * page_size
    dtype = pages.dtype if scales is None else jnp.float32
    num_keys = jnp.asarray(num_keys, jnp.int32)
    if num_pages == 0:  # nothing to read: every sequence is empty
        return jnp.zeros((batch, capacity, kv_heads, head_dim), dtype)
    pages_used = (num_keys + page_size - 1) // page_size
    in_use = jnp.arange(pages_per_seq)[None, :] < pages_used[:, None]
    ids = jnp.clip(jnp.where(in_use, jnp.asarray(page_table, jnp.int32), 0), 0, num_pages - 1)
    gathered = jnp.asarray(pages)[ids].reshape(batch, capacity, kv_heads, head_dim)
    if scales is not None:
        scales = jnp.asarray(scales, jnp.float32)
        if scales.ndim:
            scales = scales[ids].reshape(batch, capacity, kv_heads)
        gathered = dequantize_kv(gathered, scales)
    held = jnp.arange(capacity)[None, :] < num_keys[:, None]
    return jnp.where(held[:, :, None, None], gathered, jnp.zeros((), dtype))


def paged_visibility(
    first_position: Int[AnyArray, " R"],
    q_len: int,
    kv_len: int,
    *,
    sliding_window: int | tuple[int, int] | None = None,
) -> Bool[Array, "R 1 T S"]:
    """Which keys each query of paged attention sees: bottom-right causal and the window.

    Row ``r`` holds ``q_len`` queries at positions ``first_position[r] + t`` and keys at
    positions ``0..kv_len-1``; this is `visibility_mask` (causal, window) with a query
    offset per row. A query at a negative position sees no key.

    Args:
        first_position: ``[R]`` position of each row's first query
            (``kv_lens[b] - T`` for the new tokens of sequence ``b``).
        q_len: ``T``, queries per row.
        kv_len: ``S``, keys per row.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``.

    Returns:
        bool ``[R, 1, T, S]``.
    """

    def one(offset: Array) -> Array:
        mask = visibility_mask(
            q_len, kv_len, causal=True, sliding_window=sliding_window, q_offset=offset
        )
        return mask[0]

    return jax.vmap(one)(jnp.asarray(first_position, jnp.int32))


def ragged_rows(request: PagedAttentionRequest) -> tuple[Int[Array, " R"], Int[Array, " R"]]:
    """``(sequence, position)`` of each of the ``total_q`` query rows of a ragged request.

    Rows past ``cu_q_lens[-1]`` (only possible with traced values) get sequence 0 and
    position -1, which sees no key.
    """
    cu = jnp.asarray(request.cu_q_lens, jnp.int32)
    rows = jnp.arange(request.num_q_rows, dtype=jnp.int32)
    seq, local = _sequence_of(cu, rows)
    padding = seq >= request.batch
    seq = jnp.clip(seq, 0, max(request.batch - 1, 0))
    q_len = cu[seq + 1] - cu[seq]
    position = jnp.asarray(request.kv_lens, jnp.int32)[seq] - q_len + local
    return seq, jnp.where(padding, -1, position)


def paged_reference_attention(request: PagedAttentionRequest, *, return_lse: bool = False) -> Any:
    """Paged attention in float32 jnp, the definition every paged backend matches.

    The pages are gathered into a contiguous cache (`gather_pages`) and each query row
    attends, through `reference_attention` (soft cap, sinks, GQA as there), to the keys
    of its sequence that the bottom-right causal rule and the window let it see. Rows
    that see no key (idle slots, negative positions) output zeros (lse -inf, or the
    folded sink logit with sinks). FP8 pages are dequantised (`dequantize_kv`). It
    materialises every row's scores: for tests.

    Args:
        request: from `validate_paged_attention`.
        return_lse: also return the float32 log-sum-exp of each row.

    Returns:
        ``out`` in ``q.dtype`` shaped like ``q`` (``[B, T, N, H]`` or ``[total_q, N, H]``),
        and with ``return_lse`` the pair ``(out, lse)``, lse ``[B, N, T]`` or ``[N, total_q]``.
    """
    table, lens = request.page_table, request.kv_lens
    keys = gather_pages(request.k_pages, table, lens, scales=request.k_scales)
    values = gather_pages(request.v_pages, table, lens, scales=request.v_scales)
    kwargs = {
        "softmax_scale": request.softmax_scale,
        "logits_soft_cap": request.logits_soft_cap,
        "softmax_sinks": request.softmax_sinks,
        "return_lse": True,
    }
    capacity = request.capacity
    q = jnp.asarray(request.q)
    if not request.is_ragged:
        q_len = request.num_q_rows
        first = jnp.asarray(request.kv_lens, jnp.int32) - q_len
        mask = paged_visibility(first, q_len, capacity, sliding_window=request.sliding_window)
        out, lse = reference_attention(q, keys, values, mask=mask, **kwargs)
        return (out, lse) if return_lse else out
    seq, position = ragged_rows(request)
    mask = paged_visibility(position, 1, capacity, sliding_window=request.sliding_window)
    out, lse = reference_attention(q[:, None], keys[seq], values[seq], mask=mask, **kwargs)
    out, lse = out[:, 0], lse[:, :, 0].T
    return (out, lse) if return_lse else out
