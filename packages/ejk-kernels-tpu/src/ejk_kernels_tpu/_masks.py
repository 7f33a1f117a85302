"""Static attention masks: hashable, lazily evaluated, composable with ``&`` and ``|``.

A mask is a ``(q_len, kv_len)`` boolean grid (True = the query may see the key).
It is never materialised whole by the kernels' preprocessing: `process_mask`
asks for one block of rows at a time through ``mask[rows, cols]``. Masks are
hashable and compare by value, so they can be static arguments of `jax.jit`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = [
    "CausalMask",
    "ChunkedCausalMask",
    "FullMask",
    "LocalMask",
    "LogicalAnd",
    "LogicalOr",
    "Mask",
    "MaskTruthValueError",
    "MultiHeadMask",
    "NumpyMask",
    "attention_mask",
    "make_causal_mask",
    "make_chunk_attention_mask",
    "make_local_attention_mask",
    "make_random_mask",
]


class MaskTruthValueError(TypeError, NotImplementedError):
    """``bool(mask)`` (``a and b``, ``a or b``): a mask has no truth value.

    A `TypeError` (ejk's error for a misuse of a value) and a `NotImplementedError` (what
    splash attention's masks raise), so code written against either catches it.
    """


def _floordiv(ids, divisor: int):
    """``ids // divisor`` for non-negative ids, NumPy or traced (``lax.div`` in a kernel: no
    sign fix-up, which Mosaic lowers only with a TPU attached)."""
    if isinstance(ids, np.ndarray | np.integer | int):
        return ids // divisor
    import jax
    import jax.numpy as jnp

    return jax.lax.div(ids, jnp.asarray(divisor, ids.dtype))


def _all_true(q_ids, kv_ids):
    """True broadcast to the shape of ``q_ids`` against ``kv_ids`` (NumPy or traced)."""
    return (q_ids == q_ids) & (kv_ids == kv_ids)


def _check_shard_count(shard_count: int, q_len: int) -> int:
    if not isinstance(shard_count, int | np.integer) or shard_count <= 0:
        raise ValueError(f"shard_count must be a positive int, got {shard_count!r}")
    if q_len % (shard_count * shard_count):
        raise ValueError(
            f"shard_count squared ({shard_count * shard_count}) must divide the mask's "
            f"q_len={q_len} (splash attention's rule for q-sequence sharding)"
        )
    return int(shard_count)


def _check_shape(shape: Sequence[int], name: str = "shape") -> tuple[int, int]:
    shape = tuple(shape)
    if len(shape) != 2 or not all(isinstance(d, int | np.integer) and d > 0 for d in shape):
        raise ValueError(f"{name} must be (q_len, kv_len) with positive ints, got {shape!r}")
    return int(shape[0]), int(shape[1])


def _check_offset(offset: int) -> int:
    if not isinstance(offset, int | np.integer):
        raise TypeError(f"offset must be an int, got {offset!r}")
    return int(offset)


def _index_range(idx: slice | int, size: int) -> np.ndarray:
    if isinstance(idx, slice):
        return np.arange(size, dtype=np.int64)[idx]
    if isinstance(idx, int | np.integer):
        if not -size <= idx < size:
            raise IndexError(f"index {idx} out of range for a mask axis of size {size}")
        return np.asarray([idx % size], dtype=np.int64)
    raise TypeError(f"masks are indexed with ints or slices, got {type(idx).__name__}")


class Mask:
    """A ``(q_len, kv_len)`` boolean attention mask; True where a query sees a key.

    Combine masks with ``a & b`` (visible in both) and ``a | b`` (visible in either).
    Index with ``mask[rows, cols]`` (ints or slices) to get a NumPy bool array.
    """

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """bool ``[len(rows), len(cols)]`` for absolute row and column indices."""
        raise NotImplementedError

    def _key(self) -> tuple:
        """The value this mask is hashed and compared by."""
        raise NotImplementedError

    def __getitem__(self, idx: tuple[slice | int, slice | int]) -> np.ndarray:
        if not isinstance(idx, tuple) or len(idx) != 2:
            raise TypeError(f"index a 2-d mask with [rows, cols], got {idx!r}")
        q_len, kv_len = self.shape
        rows = _index_range(idx[0], q_len)
        cols = _index_range(idx[1], kv_len)
        out = self._block(rows, cols)
        # An int index drops its axis, as NumPy does.
        if not isinstance(idx[0], slice):
            out = out[0]
        if not isinstance(idx[1], slice):
            out = out[..., 0]
        return out

    def __bool__(self) -> bool:
        raise MaskTruthValueError(
            f"a {type(self).__name__} has no truth value: combine masks with `&` (and) "
            "or `|` (or), not with the `and`/`or` keywords"
        )

    def __and__(self, other: Mask) -> Mask:
        return LogicalAnd(self, other)

    def __or__(self, other: Mask) -> Mask:
        return LogicalOr(self, other)

    def _indices(self, q_ids, kv_ids):
        """The mask's value at query ids ``q_ids`` and key ids ``kv_ids`` (broadcasting NumPy
        or traced int arrays), or None when the mask is not computable from indices."""
        return None

    @property
    def computable(self) -> bool:
        """Whether the mask is a function of (query index, key index) (`mask_function`)."""
        return self._indices(np.zeros((1, 1), np.int32), np.zeros((1, 1), np.int32)) is not None

    @property
    def mask_function(self):
        """``f(q_ids, kv_ids) -> bool array`` the kernels evaluate on a partial tile instead of
        loading a stored tile, or None (a `NumpyMask`, a `FullMask`: nothing to compute).

        ``q_ids`` are entries of `q_sequence`, ``kv_ids`` key indices; both broadcast (a
        column of queries against a row of keys, or the transpose in the dkv kernel).
        """
        return self._indices if self.computable else None

    @property
    def q_sequence(self) -> np.ndarray | None:
        """int32 ``[q_len]`` query positions the `mask_function` is evaluated at (``arange``),
        or None when the mask has no mask function."""
        if self.mask_function is None:
            return None
        return np.arange(self.shape[-2], dtype=np.int32)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._key() == other._key()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self._key()!r}"

    def __ejk_stable_key__(self) -> list:
        """Plain data for `ejk_config.stable_json` (executor cache keys): the class and value."""
        return [type(self).__name__, list(self._key())]

    def dense(self) -> np.ndarray:
        """The whole mask as a NumPy bool array ``[q_len, kv_len]`` (for tests and small masks)."""
        return self[:, :]


class _Shaped(Mask):
    """A 2-d mask whose ``(q_len, kv_len)`` is given to its constructor."""

    def __init__(self, shape: tuple[int, int]):
        self._shape = _check_shape(shape)

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        out = self._indices(rows[:, None], cols[None, :])
        return np.broadcast_to(out, (rows.size, cols.size))


class _Logical(Mask):
    """``left & right`` or ``left | right`` of two 2-d masks of one shape."""

    _symbol = ""

    def __init__(self, left: Mask, right: Mask):
        for side, m in (("left", left), ("right", right)):
            if not isinstance(m, Mask) or isinstance(m, MultiHeadMask):
                raise TypeError(
                    f"{side} must be a 2-d Mask (combine the per-head masks before building "
                    f"a MultiHeadMask), got {type(m).__name__}"
                )
        if left.shape != right.shape:
            raise ValueError(f"mask shapes differ: {left.shape} {self._symbol} {right.shape}")
        self.left, self.right = left, right

    @property
    def shape(self) -> tuple[int, int]:
        return self.left.shape  # type: ignore[return-value]

    @staticmethod
    def _combine(a, b):
        raise NotImplementedError

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return self._combine(self.left._block(rows, cols), self.right._block(rows, cols))

    def _indices(self, q_ids, kv_ids):
        a = self.left._indices(q_ids, kv_ids)
        b = self.right._indices(q_ids, kv_ids)
        return None if a is None or b is None else self._combine(a, b)

    def _key(self) -> tuple:
        return (self.left, self.right)

    def __repr__(self) -> str:
        return f"({self.left!r} {self._symbol} {self.right!r})"


class LogicalAnd(_Logical):
    """``left & right``: a query sees a key when both masks let it."""

    _symbol = "&"

    @staticmethod
    def _combine(a, b):
        return a & b


class LogicalOr(_Logical):
    """``left | right``: a query sees a key when either mask lets it."""

    _symbol = "|"

    @staticmethod
    def _combine(a, b):
        return a | b


class FullMask(_Shaped):
    """Every query sees every key."""

    def _indices(self, q_ids, kv_ids):
        return _all_true(q_ids, kv_ids)

    @property
    def mask_function(self):
        # Every block is full: there is nothing to compute (as in splash attention).
        return None

    def _key(self) -> tuple:
        return (self._shape,)


class CausalMask(_Shaped):
    """Query i sees key j iff ``j <= i + offset`` (``offset=0`` is top-left aligned causal).

    ``shard_count``: the number of q-sequence shards the mask will be split over (splash
    attention's argument); its square must divide q_len. It does not change the mask.
    """

    def __init__(self, shape: tuple[int, int], offset: int = 0, shard_count: int = 1):
        super().__init__(shape)
        self.offset = _check_offset(offset)
        self.shard_count = _check_shard_count(shard_count, self._shape[0])

    def _indices(self, q_ids, kv_ids):
        return kv_ids <= q_ids + self.offset

    def _key(self) -> tuple:
        return (self._shape, self.offset)


class LocalMask(_Shaped):
    """Query i sees key j iff ``i + offset - left <= j <= i + offset + right``.

    ``window_size=(left, right)``; either side may be None for no limit on that side.
    ``shard_count`` as in `CausalMask`.
    """

    def __init__(
        self,
        shape: tuple[int, int],
        window_size: tuple[int | None, int | None],
        offset: int = 0,
        shard_count: int = 1,
    ):
        super().__init__(shape)
        if not isinstance(window_size, tuple | list) or len(window_size) != 2:
            raise ValueError(f"window_size must be (left, right), got {window_size!r}")
        for side in window_size:
            if side is not None and (not isinstance(side, int | np.integer) or side < 0):
                raise ValueError(
                    f"window_size sides must be ints >= 0 or None, got {window_size!r}"
                )
        self.window_size = tuple(None if s is None else int(s) for s in window_size)
        self.offset = _check_offset(offset)
        self.shard_count = _check_shard_count(shard_count, self._shape[0])

    def _indices(self, q_ids, kv_ids):
        left, right = self.window_size
        centre = q_ids + self.offset
        out = _all_true(q_ids, kv_ids)
        if left is not None:
            out = out & (kv_ids >= centre - left)
        if right is not None:
            out = out & (kv_ids <= centre + right)
        return out

    def _key(self) -> tuple:
        return (self._shape, self.window_size, self.offset)


class ChunkedCausalMask(_Shaped):
    """Causal attention inside chunks: i sees j iff ``j <= i`` and ``i // chunk == j // chunk``.

    ``shard_count`` as in `CausalMask`.
    """

    def __init__(self, shape: tuple[int, int], chunk_size: int, shard_count: int = 1):
        super().__init__(shape)
        if not isinstance(chunk_size, int | np.integer) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = int(chunk_size)
        self.shard_count = _check_shard_count(shard_count, self._shape[0])

    def _indices(self, q_ids, kv_ids):
        same_chunk = _floordiv(q_ids, self.chunk_size) == _floordiv(kv_ids, self.chunk_size)
        return (kv_ids <= q_ids) & same_chunk

    def _key(self) -> tuple:
        return (self._shape, self.chunk_size)


class NumpyMask(Mask):
    """A mask given as a dense NumPy bool array ``[q_len, kv_len]``; hashed by its contents."""

    def __init__(self, array: np.ndarray):
        array = np.asarray(array)
        if array.ndim != 2 or array.size == 0:
            raise ValueError(f"array must be a non-empty 2-d bool array, got shape {array.shape}")
        if array.dtype != np.bool_:
            raise TypeError(f"array must have dtype bool, got {array.dtype}")
        self.array = np.array(array, copy=True)
        self.array.setflags(write=False)
        self._digest = hashlib.sha256(self.array.tobytes()).hexdigest()

    @property
    def shape(self) -> tuple[int, int]:
        return self.array.shape  # type: ignore[return-value]

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return self.array[np.ix_(rows, cols)]

    def _key(self) -> tuple:
        return (self.array.shape, self._digest)

    def __repr__(self) -> str:
        return f"NumpyMask(shape={self.array.shape}, sha256={self._digest[:12]})"


class MultiHeadMask(Mask):
    """One 2-d mask per attention head; ``shape`` is ``(heads, q_len, kv_len)``."""

    def __init__(self, masks: Sequence[Mask]):
        masks = tuple(masks)
        if not masks:
            raise ValueError("masks must hold at least one Mask, got none")
        for m in masks:
            if not isinstance(m, Mask) or isinstance(m, MultiHeadMask):
                raise TypeError(f"masks must be 2-d Mask objects, got {type(m).__name__}")
        shapes = {m.shape for m in masks}
        if len(shapes) != 1:
            raise ValueError(f"every head's mask must have one shape, got {sorted(shapes)}")
        self.masks = masks

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.masks), *self.masks[0].shape)

    def __getitem__(self, idx):  # type: ignore[override]
        if not isinstance(idx, tuple) or len(idx) != 3:
            raise TypeError(f"index a MultiHeadMask with [head, rows, cols], got {idx!r}")
        head, rows, cols = idx
        if isinstance(head, slice):
            return np.stack([m[rows, cols] for m in self.masks[head]])
        return self.masks[head][rows, cols]

    def _key(self) -> tuple:
        return self.masks

    def dense(self) -> np.ndarray:
        """All heads as a NumPy bool array ``[heads, q_len, kv_len]``."""
        return np.stack([m.dense() for m in self.masks])


class _PaddedMask(_Shaped):
    """``mask`` grown to ``shape`` with False (padding rows and columns see nothing)."""

    def __init__(self, mask: Mask, shape: tuple[int, int]):
        super().__init__(shape)
        self.mask = mask

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        q_len, kv_len = self.mask.shape
        out = np.zeros((rows.size, cols.size), bool)
        rin, cin = rows < q_len, cols < kv_len
        if rin.any() and cin.any():
            out[np.ix_(rin, cin)] = self.mask._block(rows[rin], cols[cin])
        return out

    def _indices(self, q_ids, kv_ids):
        inner = self.mask._indices(q_ids, kv_ids)
        if inner is None:
            return None
        q_len, kv_len = self.mask.shape
        return inner & (q_ids < q_len) & (kv_ids < kv_len)

    def _key(self) -> tuple:
        return (self.mask, self._shape)


class _StoredMask(Mask):
    """``mask``'s values with no mask function: the kernels load its partial tiles."""

    def __init__(self, mask: Mask):
        self.mask = mask

    @property
    def shape(self) -> tuple[int, int]:
        return self.mask.shape  # type: ignore[return-value]

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return self.mask._block(rows, cols)

    def _key(self) -> tuple:
        return (self.mask,)


def stored_tiles(mask: Mask) -> Mask:
    """``mask`` (2-d or multi-head) without its mask function, so its partial tiles are stored."""
    if isinstance(mask, MultiHeadMask):
        return MultiHeadMask([stored_tiles(m) for m in mask.masks])
    return _StoredMask(mask)


def pad_mask(mask: Mask, q_len: int, kv_len: int) -> Mask:
    """``mask`` (2-d or multi-head) grown with False rows/columns to ``(q_len, kv_len)``."""
    if isinstance(mask, MultiHeadMask):
        return MultiHeadMask([pad_mask(m, q_len, kv_len) for m in mask.masks])
    if mask.shape == (q_len, kv_len):
        return mask
    return _PaddedMask(mask, (q_len, kv_len))


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
) -> Mask:
    """The `Mask` for the facade's ``causal`` / ``sliding_window`` options (top-left aligned).

    Args:
        q_len, kv_len: T and S.
        causal: query i sees keys ``j <= i``.
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``: keys in ``[i - left, i + right]``.

    Returns:
        `FullMask`, `CausalMask` or `LocalMask` of shape ``(q_len, kv_len)``.
    """
    shape = (q_len, kv_len)
    if sliding_window is None:
        return CausalMask(shape) if causal else FullMask(shape)
    if isinstance(sliding_window, int | np.integer):
        sliding_window = (int(sliding_window), int(sliding_window))
    if (
        not isinstance(sliding_window, tuple | list)
        or len(sliding_window) != 2
        or not all(isinstance(w, int | np.integer) and w >= 0 for w in sliding_window)
    ):
        raise ValueError(
            f"sliding_window must be an int or (left, right) ints >= 0, got {sliding_window!r}"
        )
    left, right = sliding_window
    # Causal caps the right side at the diagonal.
    return LocalMask(shape, window_size=(int(left), 0 if causal else int(right)))


def make_causal_mask(shape: tuple[int, int], offset: int = 0) -> np.ndarray:
    """Dense bool ``[q_len, kv_len]`` of `CausalMask` (``j <= i + offset``).

    Args:
        shape: ``(q_len, kv_len)``.
        offset: shifts the diagonal up (> 0) or down (< 0).

    Returns:
        NumPy bool array of ``shape``.
    """
    return CausalMask(shape, offset=offset).dense()


def make_local_attention_mask(
    shape: tuple[int, int],
    window_size: tuple[int | None, int | None],
    *,
    offset: int = 0,
) -> np.ndarray:
    """Dense bool ``[q_len, kv_len]`` of `LocalMask` (keys in ``[i + offset - left, i + offset + right]``).

    Args:
        shape: ``(q_len, kv_len)``.
        window_size: ``(left, right)``; a side of None has no limit.
        offset: shifts the window's centre.

    Returns:
        NumPy bool array of ``shape``.
    """
    return LocalMask(shape, window_size=window_size, offset=offset).dense()


def make_chunk_attention_mask(shape: tuple[int, int], chunk_size: int) -> np.ndarray:
    """Dense bool ``[q_len, kv_len]`` of `ChunkedCausalMask` (causal inside chunks of ``chunk_size``).

    Raises:
        ValueError: ``chunk_size`` is not a positive int.
    """
    return ChunkedCausalMask(shape, chunk_size=chunk_size).dense()


def make_random_mask(shape: tuple[int, int], sparsity: float, seed: int) -> np.ndarray:
    """A random dense bool mask: each entry False with probability ``sparsity``.

    Drawn from ``np.random.default_rng(seed)`` (NumPy's global random state is left alone).

    Args:
        shape: ``(q_len, kv_len)``.
        sparsity: probability in ``[0, 1]`` that a query does not see a key.
        seed: the generator's seed.

    Returns:
        NumPy bool array of ``shape``.
    """
    shape = _check_shape(shape)
    if not 0.0 <= float(sparsity) <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity!r}")
    return np.random.default_rng(seed).random(shape) >= float(sparsity)
