"""The common mask_mods, and `and_masks` / `or_masks` to combine them.

A mask_mod is ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on int32 scalars (``h`` is the
query head): True where query ``q_idx`` of batch row ``b`` and head ``h`` may see key
``kv_idx``. Any function of that signature works; the ones here are
`jax.tree_util.Partial` objects over module-level functions, so the arrays they capture
(document ids, prefix lengths) are pytree leaves: a `BlockMask` built from them crosses
``jax.jit`` as data, and new ids every batch reuse one compiled function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax.tree_util import Partial

from ejk_sequtils import normalize_window

__all__ = [
    "and_masks",
    "causal_mask",
    "check_captures",
    "document_mask",
    "or_masks",
    "prefix_lm_mask",
    "sliding_window_mask",
]


def _causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    del b, h
    return q_idx >= kv_idx


# Query i sees keys j <= i (top-left aligned, as ``causal=True`` in `flash_attention`).
causal_mask = Partial(_causal)


@dataclasses.dataclass(frozen=True)
class _Window:
    """Keys in ``[q_idx - left, q_idx + right]``. The sizes are static (not pytree leaves):
    a `BlockMask` passed into ``jax.jit`` keeps them as ints, so the facade can still hand
    the window to the built-in kernels (`_builtin`); equal windows compare and hash equal."""

    left: int
    right: int

    def __call__(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        del b, h
        return (kv_idx >= q_idx - self.left) & (kv_idx <= q_idx + self.right)


def sliding_window_mask(window: int | tuple[int, int]) -> Partial:
    """Query i sees keys in ``[i - left, i + right]``, as ``sliding_window`` in `flash_attention`.

    Args:
        window: ``(left, right)``, or ``w`` for ``(w, w)``; combine with `causal_mask`
            (`and_masks`) for a causal window.

    Returns:
        the mask_mod.
    """
    if window is None:
        raise TypeError("sliding_window_mask: window must be an int or (left, right), got None")
    left, right = normalize_window(window, "sliding_window_mask: window")
    return Partial(_Window(left, right))


def _batch_row(values: Any, b: Any) -> Any:
    """``values[b]``, or ``values[0]`` when one row serves every batch row."""
    return values[0] if values.shape[0] == 1 else values[b]


def _row(ids: Any, b: Any, idx: Any) -> Any:
    """``ids[b, idx]`` of ``[B, L]`` (or ``[1, L]``) ids, ``ids[idx]`` of ``[L]`` ids."""
    return ids[idx] if ids.ndim == 1 else _batch_row(ids, b)[idx]


def _document(q_ids: Any, kv_ids: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    del h
    q_doc = _row(q_ids, b, q_idx)
    return (q_doc == _row(kv_ids, b, kv_idx)) & (q_doc >= 0)


def document_mask(ids: Any) -> Partial:
    """Tokens see the tokens of their own document, as ``segment_ids`` in `flash_attention`.

    Args:
        ids: integer ``[B, T]`` (``[1, T]`` or ``[T]``: the same for every batch row) for
            self-attention, or ``(q_ids [B, T], kv_ids [B, S])``; equal ids >= 0 attend, a negative id is
            padding. Arrays or tracers (ids that change every batch under ``jax.jit``).

    Returns:
        the mask_mod (combine with `causal_mask` for causal documents).

    Raises:
        TypeError, ValueError: ids that are not integer arrays of rank 1 or 2.
    """
    q_ids, kv_ids = ids if isinstance(ids, tuple | list) else (ids, ids)
    q_ids = _index_array(q_ids, "document_mask", "ids", ranks=(1, 2), layout="[B, T] or [T]")
    kv_ids = _index_array(kv_ids, "document_mask", "ids", ranks=(1, 2), layout="[B, S] or [S]")
    return Partial(_document, q_ids, kv_ids)


def _prefix_lm(lengths: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    del h
    prefix = lengths if lengths.ndim == 0 else _batch_row(lengths, b)
    return (kv_idx <= q_idx) | (kv_idx < prefix)


def prefix_lm_mask(lengths: Any) -> Partial:
    """Prefix-LM: every query sees the first ``lengths[b]`` keys, and the later ones causally.

    Args:
        lengths: integer ``[B]`` (a prefix length per batch row), or ``[1]`` or a scalar
            for every row.

    Returns:
        the mask_mod.
    """
    lengths = _index_array(lengths, "prefix_lm_mask", "lengths", ranks=(0, 1), layout="[B] or []")
    return Partial(_prefix_lm, lengths)


def _all_of(mods: tuple[Any, ...], b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    out = jnp.bool_(True)
    for mod in mods:
        out = out & mod(b, h, q_idx, kv_idx)
    return out


def _any_of(mods: tuple[Any, ...], b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    out = jnp.bool_(False)
    for mod in mods:
        out = out | mod(b, h, q_idx, kv_idx)
    return out


def and_masks(*mask_mods: Callable[..., Any]) -> Partial:
    """A key is visible where every one of ``mask_mods`` lets it through (none: everywhere)."""
    return Partial(_all_of, _callables(mask_mods, "and_masks"))


def or_masks(*mask_mods: Callable[..., Any]) -> Partial:
    """A key is visible where any of ``mask_mods`` lets it through (none: nowhere)."""
    return Partial(_any_of, _callables(mask_mods, "or_masks"))


def _callables(mods: tuple[Any, ...], fn: str) -> tuple[Any, ...]:
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"{fn}: every argument must be a mask_mod, got argument {i}: {mod!r}")
    return tuple(mods)


def _index_array(x: Any, fn: str, name: str, *, ranks: tuple[int, ...], layout: str) -> Any:
    """``x`` as an integer jax array (a tracer stays one) of one of ``ranks``."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{fn}: {name} must be an integer array, got {name}.dtype={x.dtype}")
    if x.ndim not in ranks:
        raise ValueError(f"{fn}: {name} must have shape {layout}, got {name}.shape={x.shape}")
    return x


def check_captures(mod: Any, where: str, batch: int | None, q_len: int, kv_len: int) -> None:
    """Check the arrays this module's mods capture against the call they serve.

    A user's own closure is checked only by tracing it (see ``_evaluate``); the shapes
    of ids and lengths captured by `document_mask` and `prefix_lm_mask` are known here,
    and a wrong one would otherwise be read out of bounds (JAX clamps) without a word.

    Args:
        mod: a mask_mod (any callable; only this module's are inspected).
        where: the public function the message names.
        batch: the batch size the mask serves (None: one mask broadcast over the batch).
        q_len: T.
        kv_len: S.

    Raises:
        ValueError: a captured array whose shape disagrees with ``(batch, q_len, kv_len)``.
    """
    if not isinstance(mod, Partial):
        return
    if mod.func in (_all_of, _any_of):
        for inner in mod.args[0]:
            check_captures(inner, where, batch, q_len, kv_len)
    elif mod.func is _document:
        for ids, length, axis in ((mod.args[0], q_len, "T"), (mod.args[1], kv_len, "S")):
            if ids.shape[-1] != length:
                raise ValueError(
                    f"{where}: document_mask ids must have {axis}={length} positions, "
                    f"got ids.shape={ids.shape}"
                )
            if ids.ndim == 2:
                _check_batch(where, "document_mask ids", ids.shape[0], batch)
    elif mod.func is _prefix_lm and mod.args[0].ndim == 1:
        _check_batch(where, "prefix_lm_mask lengths", mod.args[0].shape[0], batch)


def _check_batch(where: str, what: str, rows: int, batch: int | None) -> None:
    """Captured values with ``rows`` batch rows must serve the call's batch."""
    if batch is None and rows != 1:
        raise ValueError(
            f"{where}: {what} vary over {rows} batch rows, but B=None builds one mask for "
            f"every row; pass B={rows}"
        )
    if batch is not None and rows not in (1, batch):
        raise ValueError(f"{where}: {what} have {rows} batch rows, the call has B={batch}")
