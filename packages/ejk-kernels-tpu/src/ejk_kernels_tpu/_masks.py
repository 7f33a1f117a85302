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
    "Mask",
    "MultiHeadMask",
    "NumpyMask",
    "attention_mask",
]


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
        raise TypeError(
            f"a {type(self).__name__} has no truth value: combine masks with `&` (and) "
            "or `|` (or), not with the `and`/`or` keywords"
        )

    def __and__(self, other: Mask) -> Mask:
        return _Logical.of("and", self, other)

    def __or__(self, other: Mask) -> Mask:
        return _Logical.of("or", self, other)

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


class _Logical(Mask):
    """``a & b`` or ``a | b`` of two masks of one shape."""

    def __init__(self, op: str, left: Mask, right: Mask):
        self.op, self.left, self.right = op, left, right

    @classmethod
    def of(cls, op: str, left: Mask, right: object) -> Mask:
        if not isinstance(right, Mask) or isinstance(right, MultiHeadMask):
            raise TypeError(f"can only combine a Mask with a 2-d Mask, got {type(right).__name__}")
        if isinstance(left, MultiHeadMask):
            raise TypeError("combine the per-head masks before building a MultiHeadMask")
        if left.shape != right.shape:
            raise ValueError(f"mask shapes differ: {left.shape} {op} {right.shape}")
        return cls(op, left, right)

    @property
    def shape(self) -> tuple[int, int]:
        return self.left.shape  # type: ignore[return-value]

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        a = self.left._block(rows, cols)
        b = self.right._block(rows, cols)
        return (a & b) if self.op == "and" else (a | b)

    def _key(self) -> tuple:
        return (self.op, self.left, self.right)

    def __repr__(self) -> str:
        sym = "&" if self.op == "and" else "|"
        return f"({self.left!r} {sym} {self.right!r})"


class FullMask(_Shaped):
    """Every query sees every key."""

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return np.ones((rows.size, cols.size), bool)

    def _key(self) -> tuple:
        return (self._shape,)


class CausalMask(_Shaped):
    """Query i sees key j iff ``j <= i + offset`` (``offset=0`` is top-left aligned causal)."""

    def __init__(self, shape: tuple[int, int], offset: int = 0):
        super().__init__(shape)
        self.offset = _check_offset(offset)

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        return cols[None, :] <= rows[:, None] + self.offset

    def _key(self) -> tuple:
        return (self._shape, self.offset)


class LocalMask(_Shaped):
    """Query i sees key j iff ``i + offset - left <= j <= i + offset + right``.

    ``window_size=(left, right)``; either side may be None for no limit on that side.
    """

    def __init__(
        self,
        shape: tuple[int, int],
        window_size: tuple[int | None, int | None],
        offset: int = 0,
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

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        left, right = self.window_size
        centre = rows[:, None] + self.offset
        out = np.ones((rows.size, cols.size), bool)
        if left is not None:
            out &= cols[None, :] >= centre - left
        if right is not None:
            out &= cols[None, :] <= centre + right
        return out

    def _key(self) -> tuple:
        return (self._shape, self.window_size, self.offset)


class ChunkedCausalMask(_Shaped):
    """Causal attention inside chunks: i sees j iff ``j <= i`` and ``i // chunk == j // chunk``."""

    def __init__(self, shape: tuple[int, int], chunk_size: int):
        super().__init__(shape)
        if not isinstance(chunk_size, int | np.integer) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = int(chunk_size)

    def _block(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        r, c = rows[:, None], cols[None, :]
        return (c <= r) & (r // self.chunk_size == c // self.chunk_size)

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

    def _key(self) -> tuple:
        return (self.mask, self._shape)


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
