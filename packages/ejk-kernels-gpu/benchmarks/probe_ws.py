"""Probe: does TMA + Triton's Hopper warp specialization pay for the forward, through jax-triton?

A minimal forward (no features: plain or causal, MHA, [B, T, N, H]) in three builds:
pointer loads (8 warps, 3 stages), TMA descriptors (8 warps, 3 stages), and TMA with
``tl.range(..., warp_specialize=True)`` (4 warps per group, 2 stages; Triton makes
one producer and two consumer warpgroups, 12 warps). jax-triton 0.3.1 cannot run the
last two as is: jaxlib passes a null global-scratch pointer (device-made TMA
descriptors live there) and launches ``num_warps`` warps, not the total the
warp-specialised kernel needs, so this probe uses `ejk_kernels_gpu._launch_fix`.

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/probe_ws.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from bench_flash import _time  # this folder (run as a script)

from ejk_kernels_gpu import _launch_fix

_LOG2E = 1.4426950408889634


@triton.jit
def _step(q, k, v, acc, m_i, l_i, offs_m, offs_n, QK: tl.constexpr, MASK: tl.constexpr):
    s = tl.dot(q, tl.trans(k))
    if MASK:
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * QK)
    p = tl.math.exp2(s * QK - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def probe_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, scratch_ptr, T: tl.constexpr,
                     N: tl.constexpr, H: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     QK: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
                     LSE: tl.constexpr, PEEL: tl.constexpr):  # fmt: skip
    """CAUSAL with PEEL: the loop covers the fully visible blocks unmasked and the diagonal
    block is one masked step outside it (1: after the loop, 2: before it). LSE: how the
    log-sum-exp is stored (0 not, 1 per-row pointer store, 2 as a [BM, 16] broadcast tile
    through pointers, 3 that tile through TMA)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bn = tl.program_id(1)
    b = (bn // N).to(tl.int64)
    n = bn % N
    base = b * T * N * H + n * H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, H)
    if TMA:
        qd = tl.make_tensor_descriptor(
            q_ptr + base, shape=[T, H], strides=[N * H, 1], block_shape=[BM, H]
        )
        q = qd.load([pid_m * BM, 0])
    else:
        q = tl.load(q_ptr + base + offs_m[:, None] * (N * H) + offs_d[None, :])
    m_i = tl.zeros([BM], tl.float32) - float("inf")
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, H], tl.float32)
    hi = (pid_m + 1) * BM if CAUSAL else T
    if PEEL:
        hi = pid_m * BM  # BM == BN: the diagonal block is the only masked one
    if TMA:
        kd = tl.make_tensor_descriptor(
            k_ptr + base, shape=[T, H], strides=[N * H, 1], block_shape=[BN, H]
        )
        vd = tl.make_tensor_descriptor(
            v_ptr + base, shape=[T, H], strides=[N * H, 1], block_shape=[BN, H]
        )
        if PEEL == 2:
            offs_n = hi + tl.arange(0, BN)
            acc, m_i, l_i = _step(q, kd.load([hi, 0]), vd.load([hi, 0]), acc, m_i, l_i,
                                  offs_m, offs_n, QK, True)  # fmt: skip
        for start_n in tl.range(0, hi, BN, warp_specialize=WS):
            offs_n = start_n + tl.arange(0, BN)
            acc, m_i, l_i = _step(q, kd.load([start_n, 0]), vd.load([start_n, 0]), acc, m_i, l_i,
                                  offs_m, offs_n, QK, CAUSAL and not PEEL)  # fmt: skip
        if PEEL == 1:
            offs_n = hi + tl.arange(0, BN)
            acc, m_i, l_i = _step(q, kd.load([hi, 0]), vd.load([hi, 0]), acc, m_i, l_i,
                                  offs_m, offs_n, QK, True)  # fmt: skip
    else:
        for start_n in tl.range(0, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            kv = base + offs_n[:, None] * (N * H) + offs_d[None, :]
            acc, m_i, l_i = _step(q, tl.load(k_ptr + kv), tl.load(v_ptr + kv), acc, m_i, l_i,
                                  offs_m, offs_n, QK, CAUSAL)  # fmt: skip
    out = acc / l_i[:, None]
    if TMA:
        od = tl.make_tensor_descriptor(
            o_ptr + base, shape=[T, H], strides=[N * H, 1], block_shape=[BM, H]
        )
        od.store([pid_m * BM, 0], out.to(o_ptr.dtype.element_ty))
    else:
        tl.store(
            o_ptr + base + offs_m[:, None] * (N * H) + offs_d[None, :],
            out.to(o_ptr.dtype.element_ty),
        )
    if LSE > 0:
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log
        rows = bn * T + offs_m  # lse buffer: [B * N * T, 16], column 0 read back
        if LSE == 1:
            tl.store(lse_ptr + rows * 16, lse)
        else:
            tile = lse[:, None] + tl.zeros([BM, 16], tl.float32)
            if LSE == 2:
                tl.store(lse_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :], tile)
            else:
                ld = tl.make_tensor_descriptor(
                    lse_ptr, shape=[N * T * tl.num_programs(1) // N, 16], strides=[16, 1],
                    block_shape=[BM, 16],
                )  # fmt: skip
                ld.store([bn * T + pid_m * BM, 0], tile)


def probe_attention(q, k, v, causal, mode, lse=0, peel=0):
    """(out, lse [B, N, T]) of the probe kernel (lse is garbage when ``lse == 0``)."""
    import jax_triton

    B, T, N, H = q.shape
    bm, bn = 128, 128
    warps, stages = (4, 2) if mode == "tma+ws" else (8, 3)
    grid = (T // bm, B * N)
    out, lse_buf, _ = jax_triton.triton_call(
        q, k, v,
        kernel=probe_fwd_kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((B * N * T * 16,), jnp.float32),
                   jax.ShapeDtypeStruct((_launch_fix.scratch_bytes(grid),), jnp.uint8)),
        grid=grid, num_warps=warps, num_stages=stages,
        T=T, N=N, H=H, BM=bm, BN=bn, QK=H**-0.5 * _LOG2E, CAUSAL=causal,
        TMA=mode != "ptr", WS=mode == "tma+ws", LSE=lse, PEEL=peel,
    )  # fmt: skip
    return out, lse_buf.reshape(B, N, T, 16)[..., 0]


def _reference(q, k, v, causal):
    """float32 (out, lse [B, N, T]) of plain softmax attention."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5
    if causal:
        t = jnp.arange(q.shape[1])
        s = jnp.where(t[None, :] <= t[:, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", jnp.exp(s - lse[..., None]), v), lse


def check_variants():
    """Values and lse of each warp-specialised variant on a small input, then their speed."""
    keys = jax.random.split(jax.random.key(1), 3)
    small = [jax.random.normal(kk, (1, 2048, 4, 128), jnp.bfloat16) for kk in keys]
    B, T, N, H = 4, 4096, 32, 128
    big = [jax.random.normal(kk, (B, T, N, H), jnp.bfloat16) for kk in keys]
    # Causal with a peeled diagonal step (PEEL 1, 2) does not build in Triton 3.6:
    # "Unexpected op" in WSDataPartition (sm_90 AOT compile on the CPU machine).
    variants = [(False, 0, 0), (False, 1, 0), (False, 2, 0), (False, 3, 0)]
    for causal, lse, peel in variants:
        name = f"causal={causal} lse={lse} peel={peel}"
        try:
            f = jax.jit(lambda q, k, v, c=causal, s=lse, p=peel: probe_attention(
                q, k, v, c, "tma+ws", s, p))  # fmt: skip
            out, got_lse = f(*small)
            ref, ref_lse = _reference(*small, causal)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
            lse_err = float(jnp.max(jnp.abs(got_lse - ref_lse))) if lse else float("nan")
            t = _time(f, *big)
            flops = 4 * B * N * T * T * H / (2 if causal else 1)
            print(f"{name:30s} {flops / t / 1e12:7.1f} TFLOP/s  max|err| out {err:.3g} "
                  f"lse {lse_err:.3g}", flush=True)  # fmt: skip
        except Exception as exc:  # a probe: report and go on
            print(f"{name:30s} FAILED {type(exc).__name__}: {str(exc)[:600]}", flush=True)


def main():
    _launch_fix.SCRATCH_KERNELS.add("probe_fwd_kernel")
    _launch_fix.install()
    from ejk_kernels_gpu import flash_attention

    print(jax.devices()[0].device_kind)
    B, T, N, H = 4, 4096, 32, 128
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, N, H), jnp.bfloat16) for kk in keys)
    for causal in (False, True):
        flops = 4 * B * N * T * T * H / (2 if causal else 1)
        ref = jax.nn.dot_product_attention(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=causal
        )
        impls = {
            "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                q, k, v, is_causal=c, implementation="cudnn"
            ),
            "ejk": lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c),
        }
        for mode in ("ptr", "tma", "tma+ws"):
            impls["probe-" + mode] = lambda q, k, v, m=mode, c=causal: probe_attention(
                q, k, v, c, m
            )[0]
        for name, fn in impls.items():
            try:
                f = jax.jit(fn)
                out = f(q, k, v)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
                t = _time(f, q, k, v)
                print(f"causal={causal} {name:14s} {flops / t / 1e12:7.1f} TFLOP/s "
                      f"{t * 1e3:7.3f} ms  max|err| {err:.3g}", flush=True)  # fmt: skip
            except Exception as exc:  # a probe: report and go on
                print(f"causal={causal} {name:14s} FAILED {type(exc).__name__}: {str(exc)[:400]}")


if __name__ == "__main__":
    import sys

    _launch_fix.SCRATCH_KERNELS.add("probe_fwd_kernel")
    _launch_fix.install()
    check_variants() if "--variants" in sys.argv else main()
