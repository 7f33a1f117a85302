"""assert_allclose, attention_tolerance, generate_attention_inputs and random_document_ids."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejk_sequtils as es


def test_assert_allclose_passes_and_reports():
    es.assert_allclose(jnp.array([1.0, np.nan]), np.array([1.0 + 1e-7, np.nan]))
    es.assert_allclose(jnp.ones(3, jnp.bfloat16), np.ones(3, np.float32))
    with pytest.raises(
        AssertionError, match=r"1 of 3 elements differ\n  largest difference 0.5 at index \(1,\)"
    ):
        es.assert_allclose(jnp.array([1.0, 2.0, 3.0]), np.array([1.0, 2.5, 3.0]))
    with pytest.raises(AssertionError, match=r"largest difference nan at index \(2,\)"):
        es.assert_allclose(jnp.array([1.0, 2.0, np.nan]), np.array([1.0, 2.5, 3.0]))
    with pytest.raises(
        AssertionError, match=r"^ctx: shape mismatch: actual \(3,\) vs expected \(1, 3\)"
    ):
        es.assert_allclose(jnp.ones(3), np.ones((1, 3)), err_msg="ctx")
    with pytest.raises(AssertionError, match="dtype mismatch"):
        es.assert_allclose(jnp.ones(3), np.ones(3, np.float64), check_dtype=True)
    with pytest.raises(AssertionError, match="elements differ"):
        es.assert_allclose(jnp.array([np.nan]), np.array([np.nan]), equal_nan=False)


def test_attention_tolerance_at_a_wider_arithmetic():
    """bfloat16 computed in float32 (Triton's interpreter): float32's tolerance plus one
    bfloat16 epsilon (2^-7) per rounding: out 1, lse 0, gradients 3; a 1.03 scale fails."""
    eps = 2.0**-7
    wide = lambda q: es.attention_tolerance(jnp.bfloat16, q, computed_in=np.float32)
    assert wide("out") == pytest.approx(1e-4 + eps)
    assert wide("lse") == es.attention_tolerance(np.float32, "lse")
    assert wide("grad") == pytest.approx(2e-4 + 3 * eps)
    assert all(wide(q) < es.attention_tolerance(jnp.bfloat16, q) for q in ("out", "lse", "grad"))
    assert wide("grad") < 0.03  # 1.03·x against x: 0.03·|x| > tol·(1 + |x|) for |x| >= 4
    same = es.attention_tolerance(jnp.bfloat16, "grad", computed_in=jnp.bfloat16)
    assert same == es.attention_tolerance(jnp.bfloat16, "grad")
    with pytest.raises(
        ValueError, match="computed_in='bfloat16' must be wider than dtype='float32'"
    ):
        es.attention_tolerance(np.float32, computed_in=jnp.bfloat16)
    with pytest.raises(ValueError, match="no attention tolerance for dtype='int32'"):
        es.attention_tolerance(jnp.bfloat16, computed_in=np.int32)


def test_generate_attention_inputs():
    inputs = es.generate_attention_inputs(2, 19, 6, 40, jnp.bfloat16, kv_seq_len=23, num_kv_heads=2)
    assert inputs["query"].shape == (2, 19, 6, 40)
    assert inputs["key"].shape == inputs["value"].shape == (2, 23, 2, 40)
    assert {v.dtype for v in inputs.values()} == {jnp.dtype(jnp.bfloat16)}
    again = es.generate_attention_inputs(2, 19, 6, 40, jnp.bfloat16, kv_seq_len=23, num_kv_heads=2)
    for name in inputs:
        np.testing.assert_array_equal(inputs[name], again[name])
    other = es.generate_attention_inputs(key=jax.random.PRNGKey(3))
    assert not np.array_equal(other["query"], es.generate_attention_inputs()["query"])
    assert not np.array_equal(inputs["key"], inputs["value"])


def test_generate_attention_inputs_errors():
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        es.generate_attention_inputs(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="seq_len must be an int >= 0, got seq_len=-1"):
        es.generate_attention_inputs(seq_len=-1)
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        es.generate_attention_inputs(dtype=jnp.int32)


def test_generate_attention_inputs_under_jit():
    make = jax.jit(
        lambda key: es.generate_attention_inputs(
            2, 19, 6, 40, jnp.float32, key, kv_seq_len=23, num_kv_heads=2
        )
    )
    jitted = make(jax.random.PRNGKey(0))
    eager = es.generate_attention_inputs(2, 19, 6, 40, jnp.float32, kv_seq_len=23, num_kv_heads=2)
    for name in eager:
        np.testing.assert_allclose(jitted[name], eager[name], rtol=1e-6)


def test_random_document_ids():
    rng = np.random.default_rng(0)
    ids = es.random_document_ids(rng, 3, 500, min_len=20, max_len=90, padding=5)
    assert ids.shape == (3, 500) and ids.dtype == np.int32
    assert (ids[:, -5:] == -1).all() and (ids[:, :-5] >= 0).all()
    for row in ids[:, :-5]:
        assert (np.diff(row) >= 0).all() and row[0] == 0  # documents 0, 1, ... in order
        starts = np.flatnonzero(np.r_[True, np.diff(row) != 0, True])
        assert (np.diff(starts)[:-1] >= 20).all() and (np.diff(starts) <= 90).all()
    again = es.random_document_ids(rng, 2, 300, min_len=20, max_len=90, repeat=True)
    for row in again:
        last = row[-1]
        assert last == 0 and row[0] == 0 and (row != 0).any()  # id 0 comes back at the end
    with pytest.raises(ValueError, match="min_len"):
        es.random_document_ids(rng, 1, 10, min_len=5, max_len=4)
    with pytest.raises(ValueError, match="padding"):
        es.random_document_ids(rng, 1, 10, min_len=1, max_len=4, padding=11)
