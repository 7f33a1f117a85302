"""The real Gluon kernels on a Hopper GPU, with the assertions `test_gluon.py` makes of their
NumPy emulations on the CPU: the Gluon forward, dk/dv (dq inside or beside) and dq kernels
ran (no silent fallback to the ordinary kernels), values and lse within the tolerance table
of the float32 reference, gradients elementwise within it, and two runs of a call equal bit
for bit (dq apart where TMA reduces add it, whose order varies).

Marked ``gpu`` and skipped without a Hopper GPU (Triton's interpreter cannot run Gluon
kernels), so on the CPU it collects and skips. On the GPU machine, from the repository root
after ``source scripts/gpu/setup.sh`` (with pytest's wheels in ``.whl/``, see the README)::

    python3 -m pytest -m gpu packages/ejk-kernels-gpu/tests -p no:cacheprovider \
        --junitxml $OUT/gpu_kernels.xml

``benchmarks/gpu_conformance.py`` runs the same kernels at realistic sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention
from ejk_sequtils import random_document_ids, reference_attention


def _on_hopper() -> bool:
    """A Hopper GPU, asked without importing Triton where there is no GPU."""
    from ejk_kernels_gpu.build._triton import gpu_available

    if not gpu_available():
        return False
    from ejk_kernels_gpu.build._triton import hopper_gpu

    return hopper_gpu()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _on_hopper(), reason="the Gluon kernels run on a Hopper GPU only"),
]

GLUON = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=3, gluon=True)
THREE = FlashConfig(block_q=192, block_k=64, num_warps=4, num_stages=2, gluon=True)


def _bwd(slots: int, dq_inside: bool, head_dim: int = 128) -> FlashBackwardConfig:
    return FlashBackwardConfig(
        block_keys=64 if head_dim == 256 else 128, block_queries=64, num_warps=4,
        num_stages=slots, gluon=True, atomic_dq=dq_inside,
    )  # fmt: skip


@pytest.fixture(name="launches")
def launches_fixture(monkeypatch):
    """(kernel name, constexprs) of each launch, recorded as the calls are traced."""
    from ejk_kernels_gpu.flash import _backward_launch, _forward_launch

    seen: list[tuple[str, dict]] = []
    for module in (_forward_launch, _backward_launch):

        def spy(kernel, grid, inputs, outs, consts, _launch=module.launch, **kwargs):
            name = getattr(kernel, "__name__", None) or kernel.fn.__name__
            seen.append((name, dict(consts)))
            return _launch(kernel, grid, inputs, outs, consts, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
    return seen


# (name, B, T, S, N, K, H, kwargs, kernels that must run): the Gluon backward needs query
# lengths a multiple of 64; fp16 unless the case says otherwise.
CASES = [
    ("unmasked gqa", 2, 256, 256, 4, 2, 128, {}, {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("causal sinks T<S", 2, 192, 256, 4, 4, 128, dict(causal=True, sinks=True), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("causal T>S gqa", 1, 384, 128, 4, 1, 128, dict(causal=True), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("64 rows whole key tiles", 2, 64, 256, 4, 1, 128, dict(causal=True), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("window", 2, 384, 384, 4, 2, 128, dict(causal=True, sliding_window=(100, 0)), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("window two-sided h64", 2, 192, 320, 4, 2, 64, dict(sliding_window=(60, 30), config=GLUON), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("soft cap sinks", 2, 256, 320, 4, 2, 128, dict(causal=True, logits_soft_cap=5.0, sinks=True), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("soft cap 50 bf16 fixed shift", 2, 448, 448, 4, 4, 128, dict(causal=True, logits_soft_cap=50.0, dtype=jnp.bfloat16), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("documents", 2, 512, 512, 4, 2, 128, dict(causal=True, documents=True), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("documents repeat h64", 2, 256, 256, 4, 4, 64, dict(documents="repeat", config=GLUON, bwd_config=_bwd(2, False)), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("packed", 1, 448, 448, 4, 2, 128, dict(causal=True, packed=True), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("three consumers", 2, 320, 320, 4, 4, 128, dict(causal=True, logits_soft_cap=30.0, config=THREE), {"gluon_fwd_kernel"}),
    ("dq inside causal", 2, 256, 192, 4, 4, 128, dict(causal=True, bwd_config=_bwd(3, True)), {"gluon_fwd_kernel", "gluon_dkdv_kernel"}),
    ("dq inside gqa cap", 2, 192, 256, 8, 2, 128, dict(logits_soft_cap=20.0, bwd_config=_bwd(2, True)), {"gluon_dkdv_kernel"}),
    ("h64 gqa soft cap", 1, 320, 256, 8, 2, 64, dict(causal=True, logits_soft_cap=20.0), {"gluon_fwd_kernel", "gluon_dkdv_kernel", "gluon_dq_kernel"}),
    ("h256 causal gqa", 1, 256, 256, 4, 2, 256, dict(causal=True), {"gluon_fwd_kernel", "gluon_dkdv_wide_kernel", "gluon_dq_kernel"}),
    ("decode row", 2, 1, 300, 4, 2, 128, dict(causal=True), {"gluon_fwd_kernel"}),
]  # fmt: skip


def _inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, kwargs):
    """q, k, v, sinks and the call's keywords (documents, packing, dtype resolved)."""
    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", jnp.float16)
    sinks = None
    if kwargs.pop("sinks", False):
        sinks = jnp.asarray(rng.standard_normal(heads), jnp.float32)
    if kwargs.pop("packed", False):
        cu = jnp.asarray([0, 90, 91, 250, q_len - 3], jnp.int32)  # padding at the end
        kwargs.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    documents = kwargs.pop("documents", False)
    if documents:
        ids = random_document_ids(
            rng, batch, q_len, min_len=20, max_len=90, padding=5, repeat=documents == "repeat"
        )
        kwargs["segment_ids"] = jnp.asarray(ids)
    shapes = ((batch, q_len, heads, head_dim), *2 * ((batch, kv_len, kv_heads, head_dim),))
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)
    return q, k, v, sinks, kwargs


def _run(fn, q, k, v, sinks, d_out, kwargs):
    """(dq, dk, dv), out, lse of ``fn`` for the loss ``sum(out · d_out) + sum(live lse)``."""

    def loss(q, k, v):
        out, lse = fn(q, k, v, softmax_sinks=sinks, return_lse=True, **kwargs)
        live = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(live), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return grads, out, lse


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gluon_kernels_give_the_reference_values_and_repeat_exactly(launches, rng, close, case):
    _, batch, q_len, kv_len, heads, kv_heads, head_dim, kwargs, expected = case
    q, k, v, sinks, kwargs = _inputs(rng, batch, q_len, kv_len, heads, kv_heads, head_dim, kwargs)
    d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    grads, out, lse = _run(flash_attention, q, k, v, sinks, d_out, kwargs)
    names = {name for name, _ in launches}
    assert expected <= names, (expected - names, names)
    # dq added by TMA reduces or atomics (Gluon dk/dv ``DQ``, ordinary ``DQ_ATOMIC``)
    dq_by_reduces = any(c.get("DQ") or c.get("DQ_ATOMIC") for n, c in launches if "dkdv" in n)
    ref_kw = {n: x for n, x in kwargs.items() if n not in ("config", "bwd_config")}
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_grads, ref_out, ref_lse = _run(reference_attention, *f32, sinks, d_out, ref_kw)
    close(out.astype(jnp.float32), ref_out, q.dtype, "out")
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)  # -inf where no key
    close(jnp.where(finite, lse, 0.0), jnp.where(finite, ref_lse, 0.0), q.dtype, "lse")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        assert not bool(jnp.any(jnp.isnan(got))), name
        close(got.astype(jnp.float32), ref, q.dtype, "grad", name)
    # Determinism: a second run gives the same bits (dq by TMA reduces apart).
    again, out2, lse2 = _run(flash_attention, q, k, v, sinks, d_out, kwargs)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    for name, got, first in zip(("dq", "dk", "dv"), again, grads, strict=True):
        if name == "dq" and dq_by_reduces:
            continue
        np.testing.assert_array_equal(np.asarray(got), np.asarray(first), err_msg=name)
