"""`PagedKVCache`: a paged KV cache held as arrays, for a ``jax.jit``-ted decode loop.

The cache is a pytree of arrays only: the key and value page pools, each sequence
slot's page table row and length, and the free pages as a stack (``free_pages[:num_free]``
are free). `PagedKVCache.append` and `PagedKVCache.release` are pure functions of the
cache with static shapes, so a decode step ``cache = cache.append(k, v, seq_ids)`` (or
``PagedKVCache.append(cache, k, v, seq_ids)``) runs under ``jit`` and inside ``lax.scan``.
Jit the step with the cache donated (``donate_argnums``) so that XLA writes the new
tokens into the pages in place instead of copying the pools.

Running out is never silent and never touches another sequence: an `append` that finds
no free page (or a sequence that would outgrow its page-table row) leaves that sequence
as it was (no token written, ``kv_lens`` unchanged) and sets its ``overflow`` flag, which
stays set until the sequence is released. Check ``cache.overflow`` after a step (or
every few steps) and release or preempt sequences.

An FP8 cache (``dtype=jnp.float8_e4m3fn``) holds its pages in e4m3 and a float32 scale per
stored token and kv head (``k_scales``/``v_scales``); `append` quantises the new tokens
(`ejk_sequtils.quantize_kv`: scale = amax / 448), and `attend` (or `paged_attention` with
``k_scales=cache.k_scales, v_scales=cache.v_scales``) reads ``page * scale``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jaxtyping import Float, Int

from ejk_sequtils import FP8_KV_DTYPE, describe_value, quantize_kv

from ._paged import paged_attention

__all__ = ["PagedKVCache"]

AnyArray = Array | np.ndarray
_I32 = jnp.int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Key/value pages of up to ``max_seqs`` sequences (slots), and the free-page stack.

    Attributes:
        k_pages: ``[P, page_size, K, H]`` the pool of key pages.
        v_pages: ``[P, page_size, K, H]`` the pool of value pages.
        page_table: int32 ``[max_seqs, pages_per_seq]``; row ``s`` lists slot ``s``'s pages
            (entries past its last page are stale: never read).
        kv_lens: int32 ``[max_seqs]``, tokens held by each slot (0: free slot).
        free_pages: int32 ``[P]``; ``free_pages[:num_free]`` are the free page ids (a stack:
            pages are taken from and returned to its top).
        num_free: int32 ``[]``, free pages.
        overflow: bool ``[max_seqs]``: an `append` to this slot was refused (no free page,
            or the slot's row is full) since it was last released.
        k_scales: float32 ``[P, page_size, K]``, the scale of each stored key (FP8 cache);
            None for a cache of any other dtype.
        v_scales: likewise for the values.
    """

    # Fields are Any: JAX rebuilds pytrees with placeholders in place of arrays (tree
    # transforms, vmap axes), which shape annotations checked at runtime would refuse.
    k_pages: Any
    v_pages: Any
    page_table: Any
    kv_lens: Any
    free_pages: Any
    num_free: Any
    overflow: Any
    k_scales: Any = None
    v_scales: Any = None

    @classmethod
    def create(
        cls,
        *,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        max_seqs: int,
        pages_per_seq: int,
        dtype: Any = jnp.float32,
    ) -> PagedKVCache:
        """An empty cache: every page free, every slot empty.

        Args:
            num_pages: P, pages in the pool (shared by all sequences).
            page_size: tokens per page.
            kv_heads: K.
            head_dim: H.
            max_seqs: sequence slots (rows of the page table).
            pages_per_seq: the most pages one sequence holds (its longest length is
                ``pages_per_seq * page_size``).
            dtype: the pages' dtype: the queries' dtype of `paged_attention`, or
                ``jnp.float8_e4m3fn`` for an FP8 cache (pages quantised on `append`, with
                float32 scales per token and kv head).
        """
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("max_seqs", max_seqs),
            ("pages_per_seq", pages_per_seq),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise TypeError(f"{name} must be an int, got {name}={describe_value(value)}")
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {name}={value}")
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"dtype must be a floating dtype, got dtype={dtype!r}")
        if jnp.dtype(dtype).itemsize == 1 and jnp.dtype(dtype) != FP8_KV_DTYPE:
            raise TypeError(f"dtype in 8 bits must be float8_e4m3fn, got dtype={dtype!r}")
        shape = (num_pages, page_size, kv_heads, head_dim)
        quantized = jnp.dtype(dtype) == FP8_KV_DTYPE
        return cls(
            # Two buffers (not one array twice), so a jit may donate the cache.
            k_pages=jnp.zeros(shape, dtype),
            v_pages=jnp.zeros(shape, dtype),
            page_table=jnp.zeros((max_seqs, pages_per_seq), _I32),
            kv_lens=jnp.zeros((max_seqs,), _I32),
            # Page 0 on top: a fresh cache hands out pages 0, 1, 2, ...
            free_pages=jnp.arange(num_pages - 1, -1, -1, dtype=_I32),
            num_free=jnp.asarray(num_pages, _I32),
            overflow=jnp.zeros((max_seqs,), bool),
            k_scales=jnp.ones(shape[:3], jnp.float32) if quantized else None,
            v_scales=jnp.ones(shape[:3], jnp.float32) if quantized else None,
        )

    @property
    def is_quantized(self) -> bool:
        """Whether the pages hold fp8 with scales."""
        return self.k_scales is not None

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self.k_pages.shape[1]

    @property
    def max_seqs(self) -> int:
        """Sequence slots."""
        return self.page_table.shape[0]

    @property
    def capacity(self) -> int:
        """``pages_per_seq * page_size``: the longest sequence a slot holds."""
        return self.page_table.shape[1] * self.page_size

    def lookup(
        self, seq_ids: Int[AnyArray, " B"]
    ) -> tuple[Int[Array, "B pages_per_seq"], Int[Array, " B"]]:
        """``(page_table, kv_lens)`` of the slots ``seq_ids``, as `paged_attention` takes them.

        A negative id (a padding entry of the batch) gives an idle row (``kv_lens`` 0).
        """
        seq_ids = _seq_ids(seq_ids, self.max_seqs)
        live = seq_ids >= 0
        rows = jnp.where(live, seq_ids, 0)
        return self.page_table[rows], jnp.where(live, self.kv_lens[rows], 0)

    def append(
        self,
        k_new: Float[AnyArray, "B T K H"],
        v_new: Float[AnyArray, "B T K H"],
        seq_ids: Int[AnyArray, " B"],
        num_new: Int[AnyArray, " B"] | None = None,
    ) -> PagedKVCache:
        """Write new tokens at the end of their sequences, taking pages from the free stack.

        Sequence slot ``seq_ids[b]`` gets the tokens ``k_new[b, :num_new[b]]`` at positions
        ``kv_lens[s] ...``; pages are taken from the free stack as it grows past its last
        page. Sequences are served in batch order; one whose new pages are not all free, or
        that would outgrow ``pages_per_seq * page_size``, is left as it was and its
        ``overflow`` flag set (and, once the free pages run short, every later sequence of the
        call that needs a new page is refused too). Nothing else changes: no page of another
        sequence is written.

        Args:
            k_new: ``[B, T, K, H]`` keys of the new tokens.
            v_new: ``[B, T, K, H]`` values.
            seq_ids: int ``[B]`` slots, each at most once; ``-1`` marks a padding entry
                (skipped). Checked when concrete; traced ids out of range, and repeats of an
                id, are skipped.
            num_new: int ``[B]`` tokens of each entry to write (``<= T``); default ``T`` each.

        Returns:
            The new cache.
        """
        page_size, max_seqs = self.page_size, self.max_seqs
        pages_per_seq = self.page_table.shape[1]
        k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
        if k_new.ndim != 4 or k_new.shape[2:] != self.k_pages.shape[2:]:
            raise ValueError(
                f"k_new must be [B, T, K, H] with [K, H]={self.k_pages.shape[2:]}, got k_new.shape={k_new.shape}"
            )
        if v_new.shape != k_new.shape:
            raise ValueError(
                f"v_new must have k_new's shape {k_new.shape}, got v_new.shape={v_new.shape}"
            )
        batch, q_len = k_new.shape[:2]
        seq_ids = _seq_ids(seq_ids, max_seqs)
        if seq_ids.shape != (batch,):
            raise ValueError(
                f"seq_ids must have shape [B]=({batch},), got seq_ids.shape={seq_ids.shape}"
            )
        if num_new is None:
            num_new = jnp.full((batch,), q_len, _I32)
        else:
            num_new = jnp.clip(jnp.asarray(num_new, _I32), 0, q_len)
            if num_new.shape != (batch,):
                raise ValueError(
                    f"num_new must have shape [B]=({batch},), got num_new.shape={num_new.shape}"
                )

        live = _first_occurrence(seq_ids, max_seqs)
        rows = jnp.where(live, seq_ids, 0)
        old_len = jnp.where(live, self.kv_lens[rows], 0)
        new_len = old_len + jnp.where(live, num_new, 0)
        old_pages = (old_len + page_size - 1) // page_size
        need = (new_len + page_size - 1) // page_size - old_pages
        fits_row = new_len <= pages_per_seq * page_size
        need = jnp.where(live & fits_row, need, 0)
        taken_before = jnp.cumsum(need) - need  # pages the earlier entries take
        # An entry without a new page is always served; needy ones while the stack lasts.
        served = live & fits_row & ((need == 0) | (taken_before + need <= self.num_free))
        need = jnp.where(served, need, 0)
        taken_before = jnp.cumsum(need) - need

        # New pages: entry b's i-th new page is the one ``taken_before[b] + i`` below the top.
        max_new_pages = -(-q_len // page_size) + 1
        i = jnp.arange(max_new_pages, dtype=_I32)[None, :]
        new_page = i < need[:, None]
        stack_pos = self.num_free - 1 - (taken_before[:, None] + i)
        page_ids = self.free_pages[jnp.clip(stack_pos, 0, self.free_pages.shape[0] - 1)]
        # Out-of-range indices are dropped: only the new pages of served entries are written.
        oob_row = jnp.where(new_page, rows[:, None], max_seqs)
        page_table = self.page_table.at[oob_row, old_pages[:, None] + i].set(page_ids, mode="drop")

        # Tokens: position old_len + t of the slot, in the (now updated) page table.
        t = jnp.arange(q_len, dtype=_I32)[None, :]
        position = old_len[:, None] + t
        write = served[:, None] & (t < num_new[:, None])
        column = jnp.clip(position // page_size, 0, pages_per_seq - 1)
        page = jnp.where(write, page_table[rows[:, None], column], self.k_pages.shape[0])
        slot = position % page_size
        k_scales, v_scales = self.k_scales, self.v_scales
        if self.is_quantized:
            (k_new, k_new_scales), (v_new, v_new_scales) = quantize_kv(k_new), quantize_kv(v_new)
            k_scales = k_scales.at[page, slot].set(k_new_scales, mode="drop")
            v_scales = v_scales.at[page, slot].set(v_new_scales, mode="drop")
        k_pages = self.k_pages.at[page, slot].set(k_new.astype(self.k_pages.dtype), mode="drop")
        v_pages = self.v_pages.at[page, slot].set(v_new.astype(self.v_pages.dtype), mode="drop")

        dropped = jnp.where(live & ~served & (num_new > 0), rows, max_seqs)
        return type(self)(
            k_pages=k_pages,
            v_pages=v_pages,
            page_table=page_table,
            kv_lens=self.kv_lens.at[jnp.where(served, rows, max_seqs)].set(new_len, mode="drop"),
            free_pages=self.free_pages,
            num_free=self.num_free - jnp.sum(need),
            overflow=self.overflow.at[dropped].set(True, mode="drop"),
            k_scales=k_scales,
            v_scales=v_scales,
        )

    def attend(
        self,
        q: Float[AnyArray, "B T N H"],
        seq_ids: Int[AnyArray, " B"],
        *,
        softmax_scale: float | None = None,
        sliding_window: int | tuple[int, int] | None = None,
        logits_soft_cap: float | None = None,
        softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
        implementation: Any = None,
        config: Any = None,
    ) -> Float[Array, "B T N H"]:
        """`paged_attention` of ``q`` (the last ``T`` tokens of the slots ``seq_ids``, already
        appended) over this cache, its scales included when it is an FP8 cache.

        Args:
            q: ``[B, T, N, H]``.
            seq_ids: int ``[B]`` slots; ``-1`` (padding) gives zeros.
            softmax_scale, sliding_window, logits_soft_cap, softmax_sinks, implementation,
                config: as in `paged_attention`.

        Returns:
            ``out [B, T, N, H]`` in q's dtype.
        """
        table, kv_lens = self.lookup(seq_ids)
        return paged_attention(
            q,
            self.k_pages,
            self.v_pages,
            table,
            kv_lens,
            softmax_scale=softmax_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            softmax_sinks=softmax_sinks,
            k_scales=self.k_scales,
            v_scales=self.v_scales,
            implementation=implementation,
            config=config,
        )

    def release(self, seq_ids: Int[AnyArray, " B"]) -> PagedKVCache:
        """Free the slots ``seq_ids``: their pages go back on the free stack, their length to 0.

        Args:
            seq_ids: int ``[B]`` slots; ``-1`` marks a padding entry. Releasing an empty slot
                does nothing; a repeated id is released once.

        Returns:
            The new cache (the pages' contents are left as they were: they are never read
            past a sequence's length).
        """
        page_size, max_seqs = self.page_size, self.max_seqs
        pages_per_seq = self.page_table.shape[1]
        seq_ids = _seq_ids(seq_ids, max_seqs)
        live = _first_occurrence(seq_ids, max_seqs)
        rows = jnp.where(live, seq_ids, 0)
        count = jnp.where(live, (self.kv_lens[rows] + page_size - 1) // page_size, 0)
        pushed_before = jnp.cumsum(count) - count
        i = jnp.arange(pages_per_seq, dtype=_I32)[None, :]
        stack_pos = jnp.where(
            i < count[:, None], self.num_free + pushed_before[:, None] + i, self.free_pages.shape[0]
        )
        free_pages = self.free_pages.at[stack_pos].set(self.page_table[rows], mode="drop")
        gone = jnp.where(live, rows, max_seqs)
        return dataclasses.replace(
            self,
            free_pages=free_pages,
            num_free=self.num_free + jnp.sum(count),
            kv_lens=self.kv_lens.at[gone].set(0, mode="drop"),
            overflow=self.overflow.at[gone].set(False, mode="drop"),
        )


def _seq_ids(seq_ids: Any, max_seqs: int) -> Array:
    """``seq_ids`` as int32 ``[B]``; when concrete, each in ``[-1, max_seqs)`` and no
    non-negative id twice (traced: ids out of range are ignored, and so are repeats)."""
    if not isinstance(seq_ids, jax.Array | np.ndarray):
        raise TypeError(
            f"seq_ids must be an integer jax or NumPy array, got {type(seq_ids).__name__}"
        )
    if not jnp.issubdtype(seq_ids.dtype, jnp.integer) or seq_ids.ndim != 1:
        raise TypeError(
            f"seq_ids must be an integer array [B], got seq_ids.shape={seq_ids.shape} "
            f"seq_ids.dtype={seq_ids.dtype}"
        )
    try:
        values = np.asarray(seq_ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    if values is not None:
        bad = values[(values < -1) | (values >= max_seqs)]
        if bad.size:
            raise ValueError(
                f"seq_ids must be in [-1, {max_seqs}) (-1: padding), got {bad.tolist()}"
            )
        live = values[values >= 0]
        if np.unique(live).size != live.size:
            raise ValueError(f"seq_ids must not repeat a sequence, got seq_ids={values.tolist()}")
    return jnp.asarray(seq_ids, _I32)


def _first_occurrence(seq_ids: Array, max_seqs: int) -> Array:
    """bool ``[B]``: the entry names a slot, and no earlier entry names the same one."""
    earlier = jnp.tril(seq_ids[:, None] == seq_ids[None, :], k=-1).any(axis=1)
    return (seq_ids >= 0) & (seq_ids < max_seqs) & ~earlier
