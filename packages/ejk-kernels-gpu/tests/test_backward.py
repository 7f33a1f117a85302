"""Gradients (q, k, v, bias, sinks) against the float32 reference, in Triton's interpreter.

Not here: the TMA-reduce dq path (``DQ_TMA``, the ordinary dk/dv kernel's atomic dq on
Hopper), which Triton's interpreter cannot run (it has no descriptor reduce;
`test_dq_by_tma_is_beyond_the_interpreter` xfails on that error alone). The GPU conformance script
(`benchmarks/gpu_conformance.py`, the cases "ordinary causal h128", "ordinary plain h128"
and "ordinary dq TMA gqa odd T h64", which expect ``DQ_TMA`` to run on Hopper) checks its
gradients against the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention
from ejk_sequtils import reference_attention

CFG = FlashConfig(block_q=32, block_k=16)
BWD = FlashBackwardConfig(block_keys=32, block_queries=16)
# dq from the dk/dv kernel's atomic adds instead of the dq kernel.
ATOMIC = FlashBackwardConfig(block_keys=32, block_queries=16, atomic_dq=True)
B, T, S, N, K, H = 2, 33, 47, 4, 2, 24


def _grads(fn, q, k, v, d_out, bias, sinks, kw):
    def loss(q, k, v, bias, sinks):
        out = fn(q, k, v, bias, softmax_sinks=sinks, **kw)
        return jnp.sum(out.astype(jnp.float32) * d_out)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, bias, sinks)


def _flash(*args, bwd=BWD, **kw):
    return flash_attention(*args, config=CFG, bwd_config=bwd, **kw)


CASES = {
    "plain_bias_sinks": dict(),
    "causal_window_cap": dict(causal=True, sliding_window=(6, 2), logits_soft_cap=2.0),
    "segments_dropout": dict(segment_ids="pair", dropout_rate=0.25, dropout_seed=5),
}


@pytest.mark.parametrize("bwd", [BWD, ATOMIC], ids=["dq_kernel", "atomic_dq"])
# float16 takes bfloat16's path with another element type: the slow run keeps it.
@pytest.mark.parametrize(
    "dtype", ["float32", pytest.param("float16", marks=pytest.mark.slow), "bfloat16"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_reference(rng, make_inputs, close, case, dtype, bwd):
    q, k, v = make_inputs(rng, B, T, S, N, K, H, dtype)
    d_out = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((B, 1, T, S)), dtype)
    sinks = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
    kw = dict(CASES[case])
    if kw.get("segment_ids") == "pair":
        q_ids = np.sort(rng.integers(-1, 3, (B, T)), axis=1)
        kv_ids = np.sort(rng.integers(-1, 3, (B, S)), axis=1)
        kw["segment_ids"] = (jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32))
    got = _grads(functools.partial(_flash, bwd=bwd), q, k, v, d_out, bias, sinks, kw)
    f32 = lambda x: x.astype(jnp.float32)
    want = _grads(reference_attention, f32(q), f32(k), f32(v), d_out, f32(bias), sinks, kw)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, want, strict=True):
        close(g, w, dtype, "grad", name)


@pytest.mark.parametrize("bwd", [BWD, ATOMIC], ids=["dq_kernel", "atomic_dq"])
def test_gradients_match_reference_in_float16(rng, make_inputs, close, bwd):
    """float16's representative in the default run: causal, window and soft cap, both ways
    of computing dq (the slow run has float16's whole matrix)."""
    test_gradients_match_reference(rng, make_inputs, close, "causal_window_cap", "float16", bwd)


@pytest.mark.parametrize("bwd", [BWD, ATOMIC], ids=["dq_kernel", "atomic_dq"])
def test_varlen_gradients_with_empty_sequences_and_gqa(rng, make_inputs, close, bwd):
    cu_q = jnp.asarray([0, 11, 11, 29, 36], jnp.int32)  # empty sequence; 3 padding rows at the end
    cu_k = jnp.asarray([0, 7, 13, 13, 30], jnp.int32)  # a sequence whose queries see no key
    q, k, v = make_inputs(rng, 1, 39, 31, 4, 1, 16, "float32")
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    got = _grads(functools.partial(_flash, bwd=bwd), q, k, v, d_out, None, None, kw)[:3]
    want = _grads(reference_attention, q, k, v, d_out, None, None, kw)[:3]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        close(g, w, "float32", "grad", name)
    # Padding rows and the rows of the sequence with no keys get exactly zero gradient.
    assert bool(jnp.all(got[0][:, 36:] == 0.0))
    assert bool(jnp.all(got[0][:, 11:29] == 0.0))


def test_dq_by_tma_is_beyond_the_interpreter(rng, make_inputs, close, monkeypatch):
    """The dq path Hopper takes with ``atomic_dq`` (``DQ_TMA``), selected in the interpreter.
    Triton's interpreter has no descriptor reduce (create_descriptor_reduce): the test
    xfails on that error alone (the GPU conformance script checks the path); once the
    interpreter runs it, the gradients are compared with the reference here."""
    from ejk_kernels_gpu.flash import _backward_launch

    monkeypatch.setattr(_backward_launch, "hopper_gpu", lambda: True)
    q, k, v = make_inputs(rng, 1, 40, 48, 2, 1, 32, "float32")  # shapes no other test traces
    cfg = FlashConfig(block_q=32, block_k=16)
    bwd = FlashBackwardConfig(block_keys=32, block_queries=16, atomic_dq=True)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    kw = dict(causal=True)
    try:
        flash = functools.partial(flash_attention, config=cfg, bwd_config=bwd)
        got = _grads(flash, q, k, v, d_out, None, None, kw)[:3]
    except Exception as err:  # the interpreter's error arrives through the host callback
        if "create_descriptor_reduce" not in str(err):
            raise
        pytest.xfail("Triton's interpreter has no descriptor reduce (DQ_TMA)")
    finally:
        jax.clear_caches()  # no trace with DQ_TMA outlives the patch
    want = _grads(reference_attention, q, k, v, d_out, None, None, kw)[:3]
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        close(g, w, "float32", "grad", name)


def test_lse_cotangent_matches_reference(rng, make_inputs, close):
    """Ring attention differentiates through the returned lse: its cotangent must count."""
    q, k, v = make_inputs(rng, 1, 21, 26, 2, 1, 16, "float32")
    sinks = jnp.asarray(rng.standard_normal((2,)), jnp.float32)
    w_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((1, 2, 21)), jnp.float32)

    def loss(fn, q, k, v, sinks):
        out, lse = fn(q, k, v, causal=True, softmax_sinks=sinks, return_lse=True)
        return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

    got = jax.grad(lambda *a: loss(_flash, *a), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    want = jax.grad(lambda *a: loss(reference_attention, *a), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want, strict=True):
        close(g, w, "float32", "grad", name)


def _long_documents(rng, batch, length, repeat):
    """Runs of ids 0, 1, ... of 20-40 tokens, padding (-1) at the end; ``repeat``: the last
    document reuses id 0 (a separate run of an earlier id)."""
    rows = []
    for _ in range(batch):
        ids = np.full(length, -1, np.int32)
        start, doc = 0, 0
        while start < length - 4:
            size = int(rng.integers(20, 41))
            ids[start : min(start + size, length - 4)] = doc
            start, doc = start + size, doc + 1
        if repeat:
            ids[ids == doc - 1] = 0
        rows.append(ids)
    return jnp.asarray(np.stack(rows))


@pytest.mark.parametrize(
    ("causal", "cross", "repeat"),
    [(True, False, False), (False, False, True), (True, True, False)],
    ids=["causal_documents", "repeated_id", "cross_ids"],
)
def test_documents_as_segment_ids_skip_and_unmask_blocks_exactly(
    rng, make_inputs, close, causal, cross, repeat
):
    """Documents longer than the tiles: blocks of other documents are skipped and blocks
    inside one run without a mask; values, lse and every gradient still equal the reference."""
    t = s = 112
    q, k, v = make_inputs(rng, 2, t, s, 4, 2, 16, "float32")
    d_out = jnp.asarray(rng.standard_normal((2, t, 4, 16)), jnp.float32)
    bias = jnp.zeros((1, 1, t, s), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
    q_ids = _long_documents(rng, 2, t, repeat)
    ids = (q_ids, _long_documents(rng, 2, s, repeat)) if cross else q_ids
    kw = dict(segment_ids=ids, causal=causal)
    got = _grads(_flash, q, k, v, d_out, bias, sinks, kw)
    want = _grads(reference_attention, q, k, v, d_out, bias, sinks, kw)
    for name, g, w in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, want, strict=True):
        close(g, w, "float32", "grad", name)
    out, lse = _flash(q, k, v, return_lse=True, **kw)
    want_out, want_lse = reference_attention(q, k, v, return_lse=True, **kw)
    close(out, want_out, "float32", "out")
    close(lse, want_lse, "float32", "lse")
