"""Error messages of the public functions: what the user passed, shown by shape and dtype.

A bad argument is named by the function's own argument name and shown by its type, shape
and dtype, never by its values (a Python list as ``q`` once put its whole contents in
the message).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    flash_attention,
    paged_attention,
    ragged_paged_attention,
    reference_attention,
)

B, T, N, H = 2, 32, 4, 16
_LIST = np.zeros((B, T, N, H), np.float32).tolist()  # 85 KB as a repr
_ARRAY = jnp.zeros((B, T, N, H), jnp.float32)
_PAGES = jnp.zeros((4, 8, N, H), jnp.float32)
_TABLE = jnp.zeros((B, 2), jnp.int32)
_LENS = jnp.full((B,), 3, jnp.int32)

LIST_AS_Q = {
    "flash_attention": lambda q: flash_attention(q, _ARRAY, _ARRAY),
    "flash_attention v": lambda q: flash_attention(_ARRAY, _ARRAY, q),
    "reference_attention": lambda q: reference_attention(q, _ARRAY, _ARRAY),
    "paged_attention": lambda q: paged_attention(q, _PAGES, _PAGES, _TABLE, _LENS),
    "ragged_paged_attention": lambda q: ragged_paged_attention(
        np.asarray(q)[0].tolist(), _PAGES, _PAGES, _TABLE, _LENS, jnp.array([0, 1, 2], jnp.int32)
    ),
}


@pytest.mark.parametrize("name", list(LIST_AS_Q))
def test_a_list_is_shown_by_its_shape_not_its_values(name, no_shape_checks):
    with pytest.raises(TypeError, match=r"must be a .*array, got list of shape \(") as err:
        LIST_AS_Q[name](_LIST)
    assert len(str(err.value)) < 200, str(err.value)[:300]
    assert "0.0" not in str(err.value)


def test_an_array_for_a_number_is_shown_by_shape_and_dtype(no_shape_checks):
    big = jnp.zeros((64, 64), jnp.float32)
    with pytest.raises(TypeError) as err:
        flash_attention(_ARRAY, _ARRAY, _ARRAY, softmax_scale=big)
    assert str(err.value) == (
        "softmax_scale must be a real number, got ArrayImpl of shape (64, 64) and dtype float32"
    )
    with pytest.raises(ValueError, match=r"sliding_window must be .*, got list of shape \(300,\)$"):
        flash_attention(_ARRAY, _ARRAY, _ARRAY, sliding_window=list(range(300)))


def test_a_decreasing_cu_seqlens_shows_the_first_drop_only(no_shape_checks):
    q = jnp.zeros((1, 4000, N, H), jnp.float32)
    cu = jnp.asarray(np.r_[0, np.arange(1, 2000)[::-1], 4000], jnp.int32)
    with pytest.raises(ValueError) as err:
        flash_attention(q, q, q, cu_seqlens_q=cu)
    assert str(err.value) == (
        "cu_seqlens_q must be non-decreasing, got cu_seqlens_q[1]=1999 > cu_seqlens_q[2]=1998"
    )
