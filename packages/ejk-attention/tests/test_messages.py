"""Error messages of the public functions: what the user passed, shown by shape and dtype.

A bad argument is named by the function's own argument name and shown by its type, shape
and dtype, never by its values (a Python list as ``q`` once put its whole contents in
the message).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import (
    dot_product_attention,
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


_Q = jnp.ones((1, 16, 2, 16), jnp.float32)
# dot_product_attention's own names (jax.nn's), never flash_attention's (q, softmax_scale,
# causal, sliding_window): every backend refuses a bad call with the same message.
DPA_BAD = [
    ({"local_window_size": (-2, 0)}, ValueError, r"^local_window_size sizes must be >= 0"),
    ({"local_window_size": (1, 2, 3)}, ValueError, r"^local_window_size must be an int or"),
    ({"scale": "0.5"}, TypeError, r"^scale must be a real number or None, got '0.5'"),
    (
        {"key": _Q.astype(jnp.float16)},
        ValueError,
        r"^query, key and value must share one dtype .*key.dtype=float16",
    ),
    ({"query": _Q.astype(jnp.int32)}, ValueError, r"^query, key and value must have a floating"),
    (
        {"key": jnp.ones((1, 16, 3, 16)), "value": jnp.ones((1, 16, 3, 16))},
        ValueError,
        r"^query heads N=2 must be a multiple of key heads K=3",
    ),
    (
        {"key": jnp.ones((1, 16, 2, 8)), "value": jnp.ones((1, 16, 2, 8))},
        ValueError,
        r"^query \[B, T, N, H\] must have key's B and H",
    ),
    ({"value": jnp.ones((1, 15, 2, 16))}, ValueError, r"^key and value must have one shape"),
]


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize(
    ("changes", "error", "match"),
    DPA_BAD,
    ids=["window", "window3", "scale", "mixed", "int", "heads", "head_dim", "value"],
)
def test_dot_product_attention_names_its_own_arguments(
    implementation, changes, error, match, no_shape_checks
):
    args = {"query": _Q, "key": _Q, "value": _Q, **changes}
    with pytest.raises(error, match=match):
        dot_product_attention(**args, implementation=implementation)


def test_dot_product_attention_takes_jax_nns_scales_and_flags(no_shape_checks):
    """A scale jax.nn takes but the kernels do not (<= 0) moves on to the next backend; an
    int ``is_causal`` is a flag, as in jax.nn."""
    want = jax.nn.dot_product_attention(_Q, _Q * 0.5, _Q, scale=-0.25, is_causal=True)
    got = dot_product_attention(
        _Q, _Q * 0.5, _Q, scale=-0.25, is_causal=1, implementation=("triton", "xla")
    )
    np.testing.assert_array_equal(got, want)
    with pytest.raises(NotImplementedError, match=r"triton takes a finite scale > 0, got scale=0"):
        dot_product_attention(_Q, _Q, _Q, scale=0.0, implementation="triton")


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_dot_product_attention_converts_numpy_float64_as_jax_nn_does(implementation):
    """jax.nn converts its inputs with jnp.asarray (float64 NumPy is float32 with x64 off),
    then needs one dtype; every backend of the drop-in does the same."""
    q64 = np.asarray(np.random.default_rng(0).standard_normal(_Q.shape))
    want = jax.nn.dot_product_attention(q64, _Q, _Q * 0.5)
    got = dot_product_attention(q64, _Q, _Q * 0.5, implementation=implementation)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_flash_attention_says_it_does_not_promote(no_shape_checks):
    q64 = np.zeros(_Q.shape)
    with pytest.raises(TypeError, match=r"must share one dtype \(no promotion: cast them first\)"):
        flash_attention(q64, _Q, _Q)
