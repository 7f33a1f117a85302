"""The flex kernels' cases of gpu_conformance.py: `ejk_kernels_gpu.flex.flex_attention` at
realistic sizes against flex attention's definition computed densely in float32.

Each case builds its mods (plain functions closing over ids, lengths, slopes or a table,
as a user writes them), the block lists from the dense mask (128 x 128 blocks), and
compares the output, the lse and the gradients of q, k, v and of the score_mod's float
capture by relative L2 error. Two runs must be equal (the capture's gradient apart: XLA
adds it by scatter, which may reorder additions).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejk_kernels_gpu.flex import flex_attention
from ejk_sequtils import random_document_ids

BLOCK = 128
# (name, B, T, S, N, K, H, mods, dtype name)
FLEX_CASES = [
    ("flex causal gqa h128", 2, 2048, 2048, 16, 4, 128, "causal", "bfloat16"),
    ("flex documents causal h128", 1, 4096, 4096, 8, 8, 128, "documents", "bfloat16"),
    ("flex window h64 fp16", 2, 2048, 2048, 8, 2, 64, "window", "float16"),
    ("flex alibi causal gqa", 2, 2048, 2048, 16, 4, 128, "alibi", "bfloat16"),
    ("flex soft cap T!=S", 2, 1000, 1536, 8, 8, 128, "softcap", "bfloat16"),
    ("flex relative table window", 1, 2048, 2048, 8, 2, 128, "relative", "bfloat16"),
    ("flex prefix lm h256", 2, 1024, 1024, 8, 4, 256, "prefix", "bfloat16"),
    ("flex per-head emptied rows", 2, 1024, 1000, 8, 8, 128, "per_head", "bfloat16"),
]


def flex_mods(kind: str, B: int, T: int, S: int, N: int, rng: np.random.Generator) -> tuple:
    """``(make_score, mask_mod, param)``: ``make_score(param)`` the score_mod (or None), the
    mask_mod (or None), and the score_mod's float capture (a zero scalar where none)."""
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    none = jnp.zeros((), jnp.float32)
    if kind == "causal":
        return None, causal, none
    if kind == "documents":
        ids = jnp.asarray(random_document_ids(rng, B, T, min_len=100, max_len=400, padding=7))
        return None, lambda b, h, i, j: (ids[b, i] == ids[b, j]) & (ids[b, i] >= 0) & (i >= j), none
    if kind == "window":
        return None, lambda b, h, i, j: (j >= i - 300) & (j <= i), none
    if kind == "alibi":
        slopes = 2.0 ** (-8.0 * jnp.arange(1, N + 1, dtype=jnp.float32) / N)
        alibi = lambda p: lambda s, b, h, i, j: s - p[h] * jnp.abs(i - j).astype(jnp.float32)
        return alibi, causal, slopes
    if kind == "softcap":
        return (lambda p: lambda s, b, h, i, j: 20.0 * jnp.tanh(s / 20.0)), None, none
    if kind == "relative":
        table = jnp.asarray(0.5 * rng.standard_normal((N, 257)), jnp.float32)
        rel = lambda p: lambda s, b, h, i, j: s + p[h, jnp.clip(j - i, -128, 128) + 128]
        return rel, lambda b, h, i, j: (j >= i - 512) & (j <= i), table
    if kind == "prefix":
        lengths = jnp.asarray(rng.integers(0, T // 2, B), jnp.int32)
        return None, lambda b, h, i, j: (j <= i) | (j < lengths[b]), none
    if kind == "per_head":  # head h sees keys j >= 64·h only: rows of some heads see nothing
        return None, lambda b, h, i, j: (j >= 64 * h) & (j <= i), none
    raise ValueError(f"unknown flex case mods {kind!r}")


def _grid(B: int, N: int, T: int, S: int) -> tuple:
    shape = lambda n, axis: jnp.arange(n, dtype=jnp.int32).reshape(
        [-1 if a == axis else 1 for a in range(4)]
    )
    return shape(B, 0), shape(N, 1), shape(T, 2), shape(S, 3)


def dense_flex(q, k, v, score_mod, visible, scale):
    """Flex attention by its definition, float32: ``(out, lse)``; an emptied row gives zeros
    and lse -inf."""
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    kk, vv = (jnp.repeat(x.astype(jnp.float32), N // K, axis=2) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kk, precision="highest") * scale
    if score_mod is not None:
        s = jnp.vectorize(score_mod)(s, *_grid(B, N, T, S))
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bnts,bsnh->btnh", p, vv, precision="highest")
    lse = jnp.where(
        total[..., 0] > 0,
        jnp.log(jnp.where(total[..., 0] > 0, total[..., 0], 1.0)) + m[..., 0],
        -jnp.inf,
    )
    return out, lse


def block_lists(visible, T: int, S: int) -> tuple:
    """``(kv_blocks, q_blocks)``: FlexAttention's lists of the dense mask's 128-blocks."""
    tb, sb = -(-T // BLOCK), -(-S // BLOCK)
    vis = jnp.pad(visible, [(0, 0), (0, 0), (0, tb * BLOCK - T), (0, sb * BLOCK - S)])
    inside = jnp.pad(jnp.ones((T, S), bool), [(0, tb * BLOCK - T), (0, sb * BLOCK - S)])
    blocks = lambda x: x.reshape(*x.shape[:-2], tb, BLOCK, sb, BLOCK)
    any_ = jnp.any(blocks(vis & inside), axis=(-3, -1))
    all_ = jnp.all(blocks(vis | ~inside), axis=(-3, -1))
    kinds = jnp.where(all_, 2, jnp.where(any_, 1, 0))

    def lists(kinds):
        out = []
        for kind in (1, 2):
            hit = kinds == kind
            out += [
                jnp.sum(hit, -1, dtype=jnp.int32),
                jnp.argsort(~hit, -1, stable=True).astype(jnp.int32),
            ]
        return tuple(out)

    return lists(kinds), lists(jnp.swapaxes(kinds, -1, -2))


def relative_error(x, ref) -> float:
    """``|x - ref| / |ref|`` (L2, float32) over the entries where ``ref`` is finite."""
    x, ref = (jnp.asarray(a, jnp.float32) for a in (x, ref))
    finite = jnp.isfinite(ref)
    x, ref = jnp.where(finite, x, 0.0), jnp.where(finite, ref, 0.0)
    return float(jnp.linalg.norm(x - ref) / (jnp.linalg.norm(ref) + 1e-30))


def flex_case(rng, name, B, T, S, N, K, H, kind, dtype_name, tol) -> dict[str, Any]:
    """One flex case: errors against `dense_flex`, determinism, NaNs; the result row."""
    dtype = jnp.dtype(dtype_name)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, K, H), dtype)
    v = jax.random.normal(keys[2], (B, S, K, H), dtype)
    d_out = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    make_score, mask_mod, param = flex_mods(kind, B, T, S, N, rng)
    visible = jnp.ones((1, 1, T, S), bool)
    if mask_mod is not None:
        visible = jnp.vectorize(mask_mod)(*_grid(B, N, T, S))
    kv_blocks, q_blocks = block_lists(jnp.broadcast_to(visible, (B, N, T, S)), T, S)
    scale = H**-0.5

    def kernel(q, k, v, param):
        score_mod = None if make_score is None else make_score(param)
        return flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, kv_blocks=kv_blocks,
                              q_blocks=q_blocks, block_size=(BLOCK, BLOCK), softmax_scale=scale,
                              return_lse=True)  # fmt: skip

    def reference(q, k, v, param):
        score_mod = None if make_score is None else make_score(param)
        return dense_flex(q, k, v, score_mod, visible, scale)

    def run(fn, *args):
        def loss(q, k, v, param):
            out, lse = fn(q, k, v, param)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out.astype(jnp.float32) * d_out) + 0.1 * jnp.sum(finite), (out, lse)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(*args)

    start = time.perf_counter()
    got_g, (got_o, got_l) = run(kernel, q, k, v, param)
    again_g, (again_o, again_l) = run(kernel, q, k, v, param)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_g, (ref_o, ref_l) = run(reference, *f32, param)
    seconds = time.perf_counter() - start
    names = (
        ("dq", "dk", "dv", "dparam")
        if make_score is not None and kind != "softcap"
        else ("dq", "dk", "dv")
    )
    errs = {"out": relative_error(got_o, ref_o), "lse": relative_error(got_l, ref_l)}
    errs |= {n: relative_error(g, r) for n, g, r in zip(names, got_g, ref_g, strict=False)}
    same_inf = bool(jnp.all(jnp.isinf(got_l) == jnp.isinf(ref_l)))
    nan = any(bool(jnp.any(jnp.isnan(jnp.asarray(x, jnp.float32)))) for x in (got_o, got_l, *got_g))
    same = {n: bool(jnp.all(a == b)) for n, a, b in zip(names, got_g, again_g, strict=False)}
    same |= {"out": bool(jnp.all(got_o == again_o)), "lse": bool(jnp.all(got_l == again_l))}
    differ = sorted(n for n, ok in same.items() if not ok)
    det = not [n for n in differ if n != "dparam"]  # the capture's scatter may reorder sums
    ok = det and not nan and same_inf and max(errs.values()) <= tol
    shape = f"B{B} T{T} S{S} N{N} K{K} H{H}"
    err_txt = " ".join(f"{n}={e:.1e}" for n, e in errs.items())
    print(f"{'PASS' if ok else 'FAIL'} {name:<24} {shape:<28} {dtype.name} det={det} "
          f"{'differ=' + ','.join(differ) + ' ' if differ else ''}emptied_rows_match={same_inf} "
          f"nan={nan} {err_txt} ({seconds:.1f}s)")  # fmt: skip
    return {
        "name": name, "shape": shape, "dtype": dtype.name, "mods": kind, "errors": errs,
        "deterministic": det, "differ_between_runs": differ, "nan": nan,
        "emptied_rows_match": same_inf, "passed": ok, "seconds": round(seconds, 1),
    }  # fmt: skip
