"""`blocksparse_attention`: the xla (dense) path against the reference, pallas (interpreted) against xla."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_attention import blocksparse_attention, reference_attention
from ejk_kernels_tpu import CausalMask, ChunkedCausalMask, FullMask, LocalMask, MultiHeadMask
from ejk_sequtils import attention_tolerance

TOL = attention_tolerance("float32")
GRAD_TOL = attention_tolerance("float32", "grad")

B, T, S, N, K, H = 2, 24, 24, 4, 2, 16


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, H))
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


def _extras():
    rng = np.random.default_rng(1)
    ids = lambda: jnp.asarray(np.sort(rng.integers(-1, 3, (B, T)), 1), jnp.int32)
    return {
        "segment_ids": (ids(), ids()),
        "logits_soft_cap": 3.0,
        "softmax_sinks": jnp.linspace(-1.0, 1.0, N),
    }


@pytest.mark.parametrize(
    ("mask", "semantics"),
    [
        (FullMask((T, S)), {}),
        (CausalMask((T, S)), {"causal": True}),
        (LocalMask((T, S), (5, 2)), {"sliding_window": (5, 2)}),
        (CausalMask((T, S)) & LocalMask((T, S), (4, 4)), {"causal": True, "sliding_window": 4}),
    ],
    ids=["full", "causal", "local", "causal_and_local"],
)
def test_xla_path_matches_reference(mask, semantics):
    q, k, v = _inputs()
    kw = _extras()
    out, lse = blocksparse_attention(q, k, v, mask, return_lse=True, **kw)
    want, want_lse = reference_attention(q, k, v, return_lse=True, **kw, **semantics)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lse, want_lse, rtol=TOL, atol=TOL)

    def loss(fn, *a):
        return lambda q, k, v: jnp.sum(
            jnp.sin(fn(q, k, v, *a, **kw, **(semantics if not a else {})))
        )

    got = jax.grad(loss(blocksparse_attention, mask), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=GRAD_TOL, atol=GRAD_TOL)


def test_pallas_matches_xla_on_a_multi_head_mask():
    q, k, v = _inputs()
    mask = MultiHeadMask(
        [
            ChunkedCausalMask((T, S), 8),
            CausalMask((T, S)),
            LocalMask((T, S), (3, 0)),
            FullMask((T, S)),
        ]
    )
    kw = {"segment_ids": _extras()["segment_ids"], "return_lse": True}
    out, lse = blocksparse_attention(q, k, v, mask, implementation="pallas", **kw)
    want, want_lse = blocksparse_attention(q, k, v, mask, implementation="xla", **kw)
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    finite = np.isfinite(np.asarray(want_lse))
    np.testing.assert_allclose(
        np.asarray(lse)[finite], np.asarray(want_lse)[finite], rtol=TOL, atol=TOL
    )


def test_errors_are_named():
    q, k, v = _inputs()
    fn = blocksparse_attention
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    with pytest.raises(TypeError, match=r"mask must be an ejk_kernels_tpu Mask, got ndarray"):
        fn(q, k, v, np.ones((T, S), bool))
    with pytest.raises(ValueError, match=r"mask shape \(24, 23\) must be \(24, 24\)"):
        fn(q, k, v, CausalMask((T, S - 1)))
    with pytest.raises(
        NotImplementedError, match=r"triton: this operation runs on pallas, xla only"
    ):
        fn(q, k, v, CausalMask((T, S)), implementation=("triton",))
