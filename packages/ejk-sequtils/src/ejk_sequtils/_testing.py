"""Helpers for tests: array comparison with a useful message, random attention inputs."""

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray, Shaped

# Public functions take jax or NumPy arrays alike.
AnyArray = Array | np.ndarray


def _as_float64(x) -> np.ndarray:
    x = np.asarray(x)
    # bfloat16/float8 arrive as ml_dtypes NumPy arrays, which cast to float64 exactly.
    if np.issubdtype(x.dtype, np.complexfloating):
        return x.astype(np.complex128)
    return x.astype(np.float64)


def assert_allclose(
    actual: Shaped[AnyArray, "..."],
    expected: Shaped[AnyArray, "..."],
    rtol: float = 1e-5,
    atol: float = 1e-8,
    equal_nan: bool = True,
    check_dtype: bool = False,
    err_msg: str = "",
) -> None:
    """Assert ``|actual - expected| <= atol + rtol·|expected|`` elementwise, in float64.

    Shapes must match exactly (no broadcasting). On failure the message gives the number
    of mismatches, the largest absolute and relative difference and where they are.

    Args:
        actual: the computed array.
        expected: the reference array.
        rtol: relative tolerance.
        atol: absolute tolerance.
        equal_nan: NaNs in the same places compare equal.
        check_dtype: also require equal dtypes.
        err_msg: text put at the start of the failure message.

    Raises:
        AssertionError: on a shape or dtype mismatch, or values out of tolerance.
    """
    prefix = f"{err_msg}: " if err_msg else ""
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{prefix}shape mismatch: actual {tuple(actual.shape)} vs expected {tuple(expected.shape)}"
        )
    if check_dtype and actual.dtype != expected.dtype:
        raise AssertionError(
            f"{prefix}dtype mismatch: actual {actual.dtype} vs expected {expected.dtype}"
        )
    a, e = _as_float64(actual), _as_float64(expected)
    close = np.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if close.all():
        return
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = np.abs(a - e)
        rel = diff / np.abs(e)
    # A NaN or inf mismatch has a NaN difference: rank it largest so it is the one shown.
    bad = ~close
    rank = np.where(bad, np.nan_to_num(diff, nan=np.inf), -1.0)
    worst = np.unravel_index(np.argmax(rank), a.shape)
    finite_rel = np.where(bad & np.isfinite(rel), rel, 0)
    raise AssertionError(
        f"{prefix}arrays not close (rtol={rtol}, atol={atol}): {int(bad.sum())} of {bad.size} "
        f"elements differ\n"
        f"  largest difference {diff[worst]:.6g} at index {tuple(int(i) for i in worst)}: "
        f"actual {a[worst]!r}, expected {e[worst]!r}\n"
        f"  largest finite relative difference {finite_rel.max():.6g}"
    )


def generate_attention_inputs(
    batch_size: int = 2,
    seq_len: int = 128,
    num_heads: int = 8,
    head_dim: int = 64,
    dtype=jnp.float32,
    key: PRNGKeyArray | None = None,
    *,
    kv_seq_len: int | None = None,
    num_kv_heads: int | None = None,
    std: float = 0.02,
) -> dict[str, Float[Array, "..."]]:
    """Random normal query, key and value arrays in the ``[B, T, N, H]`` layout.

    Args:
        batch_size: B.
        seq_len: T, the query length.
        num_heads: N, query heads.
        head_dim: H.
        dtype: floating dtype of the arrays.
        key: PRNG key; None means ``jax.random.PRNGKey(0)``.
        kv_seq_len: S, the key/value length (default T).
        num_kv_heads: K, key/value heads (default N; must divide N for GQA).
        std: standard deviation of the entries.

    Returns:
        ``{"query": [B, T, N, H], "key": [B, S, K, H], "value": [B, S, K, H]}``.
    """
    kv_seq_len = seq_len if kv_seq_len is None else kv_seq_len
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    for name, value in [
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("kv_seq_len", kv_seq_len),
        ("num_kv_heads", num_kv_heads),
    ]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {name}={value!r}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype=}")
    if key is None:
        key = jax.random.PRNGKey(0)
    kq, kk, kv = jax.random.split(key, 3)
    q_shape = (batch_size, seq_len, num_heads, head_dim)
    kv_shape = (batch_size, kv_seq_len, num_kv_heads, head_dim)
    return {
        "query": (jax.random.normal(kq, q_shape, jnp.float32) * std).astype(dtype),
        "key": (jax.random.normal(kk, kv_shape, jnp.float32) * std).astype(dtype),
        "value": (jax.random.normal(kv, kv_shape, jnp.float32) * std).astype(dtype),
    }


def random_document_ids(
    rng: np.random.Generator,
    batch: int,
    length: int,
    *,
    min_len: int,
    max_len: int,
    padding: int = 0,
    repeat: bool = False,
) -> np.ndarray:
    """Segment ids of packed documents, as a model's data loader makes them (int32 NumPy).

    Each row holds documents 0, 1, ... of ``min_len`` to ``max_len`` tokens (the last one
    cut at the end), then ``padding`` tokens of id -1.

    Args:
        rng: the NumPy generator drawing the lengths.
        batch: rows.
        length: tokens per row.
        min_len, max_len: inclusive bounds of a document's length.
        padding: padding tokens (-1) at the end of each row.
        repeat: the last document of a row with more than one reuses id 0, a second run
            of the same id (its span then holds other documents).

    Returns:
        ``[batch, length]`` int32 ids.
    """
    if not 0 < min_len <= max_len:
        raise ValueError(f"need 0 < min_len <= max_len, got {min_len=}, {max_len=}")
    if not 0 <= padding <= length:
        raise ValueError(f"padding must be in [0, length={length}], got {padding}")
    ids = np.full((batch, length), -1, np.int32)
    end_of_docs = length - padding
    for row in ids:
        start = doc = 0
        while start < end_of_docs:
            end = min(start + int(rng.integers(min_len, max_len + 1)), end_of_docs)
            row[start:end] = 0 if repeat and end == end_of_docs and doc > 0 else doc
            start, doc = end, doc + 1
    return ids
