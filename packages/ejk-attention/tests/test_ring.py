"""Ring attention on 8 host CPU devices: values and gradients against the unsharded reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ejk_attention import reference_attention, ring_attention
from ejk_attention._shard_map import shard_map_compat
from ejk_sequtils import attention_tolerance

TOL = attention_tolerance("float32")
GRAD_TOL = attention_tolerance("float32", "grad")

RING = 8
B, N, K, H = 2, 4, 2, 8
TL, SL = 3, 5  # per-device block lengths: T = 24, S = 40 (distinct, so a swap fails)


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < RING:
        pytest.skip("needs 8 devices (tests/conftest.py sets the host device count)")
    return Mesh(np.array(jax.devices()[:RING]), ("sp",))


def _inputs(tl=TL, sl=SL, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B, tl * RING, N, H), (B, sl * RING, K, H), (B, sl * RING, K, H))
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)


def _segments(length, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(-1, 3, size=(B, length)), axis=1), jnp.int32)


def _ring_fn(mesh, kw, with_seg, with_sinks, check=True):
    seq = P(None, "sp")
    in_specs = [seq, seq, seq]
    if with_seg:
        in_specs.append((seq, seq))
    if with_sinks:
        in_specs.append(P())

    def local(q, k, v, *extra):
        extra = list(extra)
        seg = extra.pop(0) if with_seg else None
        sinks = extra.pop(0) if with_sinks else None
        return ring_attention(
            q, k, v, axis_name="sp", segment_ids=seg, softmax_sinks=sinks, return_lse=True, **kw
        )

    return shard_map_compat(
        local,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=(seq, P(None, None, "sp")),
        check=check,
    )


CASES = {
    "plain": ({}, False, False),
    "causal": ({"causal": True}, False, False),
    "window_softcap": ({"sliding_window": (7, 4), "logits_soft_cap": 2.0}, False, False),
    "causal_window": ({"causal": True, "sliding_window": 6}, False, False),
    "segments_causal": ({"causal": True}, True, False),
    "sinks_scale": ({"softmax_scale": 0.3}, False, True),
}


# The default run keeps one case per feature; the rest run with -m slow.
_SLOW = {"plain", "causal_window"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in _SLOW else c for c in CASES]
)
def test_values_and_gradients_match_reference(mesh, case):
    kw, with_seg, with_sinks = CASES[case]
    q, k, v = _inputs()
    extra = []
    if with_seg:
        extra.append((_segments(TL * RING, 1), _segments(SL * RING, 1)))
    if with_sinks:
        extra.append(jnp.linspace(-1.0, 1.0, N))
    ring = jax.jit(_ring_fn(mesh, kw, with_seg, with_sinks))

    def ref(q, k, v, *extra):
        extra = list(extra)
        seg = extra.pop(0) if with_seg else None
        sinks = extra.pop(0) if with_sinks else None
        return reference_attention(
            q, k, v, segment_ids=seg, softmax_sinks=sinks, return_lse=True, **kw
        )

    out, lse = ring(q, k, v, *extra)
    want, want_lse = ref(q, k, v, *extra)
    assert out.shape == want.shape and out.dtype == want.dtype
    np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(lse, want_lse, rtol=TOL, atol=TOL)

    # A loss that uses both outputs, so the lse cotangent path is checked too.
    w = jnp.asarray(np.random.default_rng(2).standard_normal(want.shape), jnp.float32)

    def loss(fn):
        def f(q, k, v, sinks=None):
            args = list(extra)
            if with_sinks:
                args[-1] = sinks
            out, lse = fn(q, k, v, *args)
            return jnp.sum(out * w) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

        return f

    argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
    grad_args = (q, k, v, extra[-1]) if with_sinks else (q, k, v)
    got = jax.jit(jax.grad(loss(ring), argnums=argnums))(*grad_args)
    want_g = jax.grad(loss(ref), argnums=argnums)(*grad_args)
    for name, g, wg in zip("q k v sinks".split(), got, want_g, strict=False):
        np.testing.assert_allclose(g, wg, rtol=GRAD_TOL, atol=GRAD_TOL, err_msg=name)


def test_equal_blocks_with_sinks_without_vma_checks(mesh):
    q, k, v = _inputs(tl=4, sl=4, seed=3)
    sinks = jnp.linspace(-1.0, 1.0, N)
    ring = jax.jit(_ring_fn(mesh, {"causal": True}, False, True, check=False))
    loss = lambda fn: lambda *a: jnp.sum(jnp.sin(fn(*a)[0])) + jnp.sum(fn(*a)[1])
    ref = lambda q, k, v, s: reference_attention(
        q, k, v, causal=True, softmax_sinks=s, return_lse=True
    )
    np.testing.assert_allclose(ring(q, k, v, sinks)[0], ref(q, k, v, sinks)[0], rtol=TOL, atol=TOL)
    got = jax.grad(loss(ring), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, wg in zip(got, want, strict=True):
        np.testing.assert_allclose(g, wg, rtol=GRAD_TOL, atol=GRAD_TOL)


def test_bad_arguments_are_named(mesh):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"sliding_window sizes must be >= 0"):
        ring_attention(q, k, v, axis_name="sp", sliding_window=(-1, 2))
