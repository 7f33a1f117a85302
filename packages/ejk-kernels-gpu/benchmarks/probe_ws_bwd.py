"""Probe: does Triton's Hopper warp specialisation pay for the backward, through jax-triton?

Two minimal backward kernels for MHA ([B, T, N, H], T a multiple of 128; unmasked or
causal, masked on every block with block-relative positions as the forward), each one
TMA-fed loop with ``tl.range(..., warp_specialize=True)``, so Triton makes a producer
warpgroup and two consumer warpgroups that each own half of the resident tile
(FlashAttention-3's layout):

- dk/dv: 128 resident keys, 64 queries streamed per step; per consumer the dk and dv
  accumulators are [64, H], so the sm_90 build needs 168 registers and spills nothing,
  where the library's 8-warp dk/dv kernel sits at 255 and spills (docs/performance.md,
  step 5). dq cannot come from it: a TMA reduce of ``dS·K`` in the loop does not build.
- dq: 128 resident queries, 128 keys streamed per step.

``main`` checks both against the f32 reference on a small input and times them beside the
library's backward and cuDNN's, in one process (docs/performance.md, step 6).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/probe_ws_bwd.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from bench_flash import median_time  # this folder (run as a script)

from ejk_kernels_gpu import _launch_fix, flash_attention

_LOG2E = 1.4426950408889634


@triton.jit
def _slab(ptr, bn, T: tl.constexpr, N: tl.constexpr, H: tl.constexpr, ROWS: tl.constexpr):
    """Descriptor of (batch, head) ``bn``'s [T, H] slab of a [B, T, N, H] tensor."""
    base = (bn // N).to(tl.int64) * (T * N * H) + (bn % N) * H
    return tl.make_tensor_descriptor(ptr + base, [T, H], [N * H, 1], [ROWS, H])


@triton.jit
def _rows(ptr, bn, T: tl.constexpr, ROWS: tl.constexpr):
    """Descriptor of (batch, head) ``bn``'s row of a [B, N, T] float32 statistic."""
    return tl.make_tensor_descriptor(ptr + bn.to(tl.int64) * T, [T], [1], [ROWS])


@triton.jit
def probe_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                      scratch_ptr, T: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, QK: tl.constexpr, SCALE: tl.constexpr,
                      WS: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """dk, dv of key block ``program_id(0)``: transposed tiles, ``lse`` in log2 units."""
    pid_n = tl.program_id(0)
    bn = tl.program_id(1)
    qd = _slab(q_ptr, bn, T, N, H, BM)
    dod = _slab(do_ptr, bn, T, N, H, BM)
    ld = _rows(lse_ptr, bn, T, BM)
    dd = _rows(delta_ptr, bn, T, BM)
    k = _slab(k_ptr, bn, T, N, H, BN).load([pid_n * BN, 0])
    v = _slab(v_ptr, bn, T, N, H, BN).load([pid_n * BN, 0])
    dk = tl.zeros([BN, H], tl.float32)
    dv = tl.zeros([BN, H], tl.float32)
    key0 = pid_n * BN
    for start_m in tl.range(key0 if CAUSAL else 0, T, BM, warp_specialize=WS):
        q = qd.load([start_m, 0])
        do = dod.load([start_m, 0])
        st = tl.dot(k, tl.trans(q))
        if CAUSAL:  # key row i sees query column j iff key0 + i <= start_m + j
            lim = tl.arange(0, BN) - (start_m - key0)
            st = tl.where(tl.arange(0, BM)[None, :] >= lim[:, None], st, float("-inf"))
        pt = tl.math.exp2(st * QK - ld.load([start_m])[None, :])
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dst = pt * (tl.dot(v, tl.trans(do)) - dd.load([start_m])[None, :])
        dk = tl.dot(dst.to(q.dtype), q, dk)
    _slab(dk_ptr, bn, T, N, H, BN).store([pid_n * BN, 0], (dk * SCALE).to(dk_ptr.dtype.element_ty))
    _slab(dv_ptr, bn, T, N, H, BN).store([pid_n * BN, 0], dv.to(dv_ptr.dtype.element_ty))


@triton.jit
def probe_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, scratch_ptr,
                    T: tl.constexpr, N: tl.constexpr, H: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, QK: tl.constexpr, SCALE: tl.constexpr,
                    WS: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """dq of query block ``program_id(0)``."""
    pid_m = tl.program_id(0)
    bn = tl.program_id(1)
    kd = _slab(k_ptr, bn, T, N, H, BN)
    vd = _slab(v_ptr, bn, T, N, H, BN)
    row0 = pid_m * BM
    q = _slab(q_ptr, bn, T, N, H, BM).load([row0, 0])
    do = _slab(do_ptr, bn, T, N, H, BM).load([row0, 0])
    lse = _rows(lse_ptr, bn, T, BM).load([row0])
    delta = _rows(delta_ptr, bn, T, BM).load([row0])
    dq = tl.zeros([BM, H], tl.float32)
    for start_n in tl.range(0, row0 + BM if CAUSAL else T, BN, warp_specialize=WS):
        k = kd.load([start_n, 0])
        s = tl.dot(q, tl.trans(k))
        if CAUSAL:  # query row i sees key column j iff start_n + j <= row0 + i
            lim = tl.arange(0, BM) - (start_n - row0)
            s = tl.where(tl.arange(0, BN)[None, :] <= lim[:, None], s, float("-inf"))
        p = tl.math.exp2(s * QK - lse[:, None])
        ds = p * (tl.dot(do, tl.trans(vd.load([start_n, 0]))) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    _slab(dq_ptr, bn, T, N, H, BM).store([row0, 0], (dq * SCALE).to(dq_ptr.dtype.element_ty))


def probe_backward(q, k, v, out, lse, d_out, ws=True, causal=False):
    """(dq, dk, dv) of MHA from the forward's ``out`` and natural-log ``lse``."""
    import jax_triton

    B, T, N, H = q.shape
    d_out = d_out.astype(q.dtype)
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), d_out.astype(jnp.float32))
    lse2 = lse * _LOG2E
    consts = dict(T=T, N=N, H=H, QK=H**-0.5 * _LOG2E, SCALE=H**-0.5, WS=ws, CAUSAL=causal)
    warps = 4 if ws else 8
    grids = {"dkdv": (T // 128, B * N), "dq": (T // 128, B * N)}
    dk, dv, _ = jax_triton.triton_call(
        q, k, v, d_out, lse2, delta,
        kernel=probe_dkdv_kernel,
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((_launch_fix.scratch_bytes(grids["dkdv"]),), jnp.uint8)),
        grid=grids["dkdv"], num_warps=warps, num_stages=2, BM=64, BN=128, **consts,
    )  # fmt: skip
    dq, _ = jax_triton.triton_call(
        q, k, v, d_out, lse2, delta,
        kernel=probe_dq_kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((_launch_fix.scratch_bytes(grids["dq"]),), jnp.uint8)),
        grid=grids["dq"], num_warps=warps, num_stages=2, BM=128, BN=128, **consts,
    )  # fmt: skip
    return dq, dk, dv


def _rel(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def main():
    _launch_fix.SCRATCH_KERNELS.update({"probe_dkdv_kernel", "probe_dq_kernel"})
    _launch_fix.install()
    print("triton", triton.__version__, jax.devices()[0].device_kind, flush=True)
    keys = jax.random.split(jax.random.key(2), 4)

    def inputs(shape, causal):
        q, k, v, d = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        return q, k, v, out, lse, d

    for causal in (False, True):
        # Values: relative L2 error of each gradient against the f32 reference.
        q, k, v, out, lse, d = inputs((2, 1024, 4, 128), causal)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref = jax.vjp(lambda q, k, v, c=causal: jax.nn.dot_product_attention(q, k, v, is_causal=c),
                      *f32)[1](d.astype(jnp.float32))  # fmt: skip
        for ws in (True, False):
            fn = jax.jit(lambda *a, ws=ws, c=causal: probe_backward(*a, ws=ws, causal=c))
            got = fn(q, k, v, out, lse, d)
            errs = " ".join(
                f"{n}={_rel(g, r):.1e}"
                for n, g, r in zip("dq dk dv".split(), got, ref, strict=True)
            )
            print(f"causal={causal} probe ws={ws}: {errs}", flush=True)

        # Speed: backward only (the forward's out and lse given), beside the library and cuDNN.
        B, T, N, H = 4, 4096, 32, 128
        q, k, v, out, lse, d = inputs((B, T, N, H), causal)
        bwd_flops = 2.5 * 4 * B * N * T * T * H / (2 if causal else 1)
        for ws in (True, False):
            fn = jax.jit(lambda *a, ws=ws, c=causal: probe_backward(*a, ws=ws, causal=c))
            t = median_time(fn, q, k, v, out, lse, d)
            print(f"causal={causal} probe ws={ws!s:5} bwd {bwd_flops / t / 1e12:7.1f} TFLOP/s "
                  f"{t * 1e3:7.3f} ms", flush=True)  # fmt: skip
        for name, attn in (
            ("ejk", lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c)),
            ("cudnn", lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                q, k, v, is_causal=c, implementation="cudnn")),
        ):  # fmt: skip
            fwd = jax.jit(attn)
            both = jax.jit(lambda q, k, v, d, attn=attn: jax.vjp(attn, q, k, v)[1](d))
            t = median_time(both, q, k, v, d) - median_time(fwd, q, k, v)
            print(f"causal={causal} {name:14s} bwd {bwd_flops / t / 1e12:7.1f} TFLOP/s "
                  f"{t * 1e3:7.3f} ms (fwd+bwd minus fwd)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
