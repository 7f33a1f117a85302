"""Decoding and serving: GB/s of ejk's split-KV paged attention against cuDNN and tokamax.

In one process, bf16: first the kernel's values against `ejk_sequtils.paged_reference_attention`
(fresh random inputs, shared and out-of-order pages, window / soft cap / sinks, ragged),
then timings in interleaved rounds (see `bench_flash.bench_shape`) of

- contiguous decode (T = 1): ``paged_attention`` on the cache ``[B, S, K, H]`` viewed as
  one page per sequence, and ``flash_attention`` (its split-KV decode route), against
  ``jax.nn.dot_product_attention(implementation="cudnn")`` on the same cache;
- paged decode: the same cache in pages of 64 tokens in shuffled order, in bf16 and as an
  FP8 cache (e4m3 pages, float32 scales per token and kv head: `ejk_sequtils.quantize_kv`),
  whose row also gives its speed-up over the bf16 paged call and its output's relative
  error (Frobenius norm) against it;
- a ragged serving batch (8 prefill chunks of 512 tokens and 56 decode tokens over 4k
  contexts) in one call, against its prefill part and its decode part as two calls.

GB/s = bytes of k and v the call must read / time (each key a sequence sees, once; for the
FP8 cache one byte per element plus its scales).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/bench_decode.py [--sweep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import _tokamax
import jax
import jax.numpy as jnp
import numpy as np
from _timing import contender, time_rounds

from ejk_kernels_gpu import PagedConfig, flash_attention, paged_attention
from ejk_sequtils import (
    attention_tolerance,
    paged_reference_attention,
    quantize_kv,
    validate_paged_attention,
)

# (B, S, N, K, H): the contiguous decode shapes.
# The B1 rows at 8k and 32k after the first three (indices stay those of older runs).
DECODE_SHAPES = [(32, 8192, 32, 8, 128), (8, 32768, 32, 8, 128), (1, 131072, 32, 8, 128),
                 (1, 8192, 32, 8, 128), (1, 32768, 32, 8, 128)]  # fmt: skip
PAGE = 64


def interleaved(variants: dict, rounds: int) -> dict:
    """``{name: (median s, best s, spread)}`` of ``variants = {name: (jitted fn, args)}``,
    timed in interleaved rounds (`_timing`); a variant that fails is reported and left out."""
    cases = [
        contender(dict(impl=name), fn, (*args, None), with_bwd=False)
        for name, (fn, args) in variants.items()
    ]
    for row, _, _ in cases:
        if "error" in row:
            print(json.dumps(row), flush=True)
    rows = time_rounds([c for c in cases if "error" not in c[0]], rounds, 0.0)
    return {r["impl"]: (r["fwd_ms"] * 1e-3, r["fwd_best_ms"] * 1e-3, r["fwd_spread"]) for r in rows}


def paged_cache(rng, k, v, page: int):
    """The contiguous cache ``[B, S, K, H]`` as shuffled pages of ``page`` tokens."""
    batch, seq, kv_heads, head_dim = k.shape
    per = seq // page
    order = rng.permutation(batch * per)
    table = jnp.asarray(order.reshape(batch, per), jnp.int32)
    inverse = jnp.asarray(np.argsort(order), jnp.int32)

    def pages(x):
        return x.reshape(batch * per, page, kv_heads, head_dim)[inverse]

    return pages(k), pages(v), table


def kv_bytes(B: int, S: int, K: int, H: int, fp8: bool) -> int:
    """Bytes of k and v a decode call over ``B`` sequences of ``S`` keys reads: bf16, or
    e4m3 with a float32 scale per token and kv head."""
    return 2 * B * S * K * (H + 4 if fp8 else 2 * H)


def fp8_cache(k_pages, v_pages) -> tuple:
    """``(k_pages, v_pages, scales)``: the pools quantised per token and kv head, and the
    ``k_scales``/``v_scales`` keywords of the call."""
    (kq, ks), (vq, vs) = quantize_kv(k_pages), quantize_kv(v_pages)
    return kq, vq, {"k_scales": ks, "v_scales": vs}


def check_values(rng) -> list[dict]:
    """bf16 values (and an FP8 cache's) against the float32 reference on fresh random calls."""
    rows = []
    cases = [
        dict(B=5, T=1, N=32, K=8, H=128, page=64, pps=40, cfg=None),
        dict(B=3, T=7, N=16, K=2, H=128, page=16, pps=64, cfg=None, window=(300, 0)),
        dict(B=4, T=1, N=8, K=1, H=64, page=128, pps=16, cfg=PagedConfig(num_splits=5)),
        dict(B=4, T=3, N=8, K=8, H=256, page=32, pps=20, cfg=None, cap=20.0, sinks=True),
        # FP8 pages: the reference dequantises the same e4m3 pages and scales.
        dict(B=5, T=1, N=32, K=8, H=128, page=64, pps=40, cfg=None, fp8=True),
        dict(B=3, T=4, N=8, K=2, H=64, page=16, pps=30, cfg=PagedConfig(num_splits=3), fp8=True),
        # The reference gathers every row's keys: a small pool.
        dict(B=6, T=0, N=16, K=4, H=128, page=32, pps=12, cfg=None, ragged=[200, 1, 0, 37, 1, 90]),
    ]  # fmt: skip
    for case in cases:
        B, T, N, K, H, page, pps = (case[x] for x in ("B", "T", "N", "K", "H", "page", "pps"))
        pool = B * pps
        table = rng.integers(0, pool, (B, pps)).astype(np.int32)  # shared and out of order
        kv_lens = rng.integers(0, pps * page + 1, B).astype(np.int32)
        kv_lens[0], kv_lens[-1] = pps * page, 0
        kp = jnp.asarray(rng.standard_normal((pool, page, K, H)), jnp.bfloat16)
        vp = jnp.asarray(rng.standard_normal((pool, page, K, H)), jnp.bfloat16)
        kwargs = dict(
            sliding_window=case.get("window"),
            logits_soft_cap=case.get("cap"),
            softmax_sinks=jnp.asarray(rng.standard_normal(N), jnp.float32)
            if case.get("sinks")
            else None,
        )
        if case.get("fp8"):
            kp, vp, scales = fp8_cache(kp, vp)
            kwargs.update(scales)
        if "ragged" in case:
            q_lens = np.array(case["ragged"])
            kv_lens = np.maximum(kv_lens, q_lens).astype(np.int32)
            kv_lens = np.minimum(kv_lens, pps * page).astype(np.int32)
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
            q = jnp.asarray(rng.standard_normal((int(cu[-1]), N, H)), jnp.bfloat16)
            kwargs["cu_q_lens"] = cu
        else:
            q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
        args = (q, kp, vp, jnp.asarray(table), jnp.asarray(kv_lens))
        out = jax.jit(lambda *a, kw=kwargs, c=case["cfg"]: paged_attention(*a, config=c, **kw))(
            *args
        )
        ref = paged_reference_attention(validate_paged_attention(*args, **kwargs))
        out32, ref32 = out.astype(jnp.float32), ref.astype(jnp.float32)
        err = float(jnp.max(jnp.abs(out32 - ref32)))
        rel = float(jnp.linalg.norm(out32 - ref32) / jnp.maximum(jnp.linalg.norm(ref32), 1e-30))
        tol = attention_tolerance(jnp.bfloat16, "out")
        row = dict(
            check={k: v for k, v in case.items() if k != "cfg"},
            max_abs_err=err,
            rel_err=rel,
            tol=tol,
            passed=bool(jnp.all(jnp.abs(out32 - ref32) <= tol + tol * jnp.abs(ref32))),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds * 1e-9


def bench_decode(rng, shape, rounds: int, configs: dict, fp8_configs: dict) -> list[dict]:
    """Contiguous and paged decode of one shape: ejk (heuristic and ``configs`` on the
    contiguous cache, ``fp8_configs`` on the FP8 paged one) and cuDNN."""
    B, S, N, K, H = shape
    keys = jax.random.split(jax.random.key(sum(shape)), 3)
    # Drawn in float32, then rounded: normals drawn in bfloat16 have a mean of about -0.01,
    # which the near-zero outputs of random attention turn into a large relative FP8 error.
    q, k, v = (
        jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
        for key, shape in zip(keys, [(B, 1, N, H), (B, S, K, H), (B, S, K, H)], strict=True)
    )
    kv_lens = jnp.full((B,), S, jnp.int32)
    one_page = jnp.arange(B, dtype=jnp.int32)[:, None]
    kp, vp, table = paged_cache(rng, k, v, PAGE)

    def contiguous(cfg):
        return jax.jit(lambda q, k, v: paged_attention(q, k, v, one_page, kv_lens, config=cfg))

    def paged(cfg):
        return jax.jit(lambda q, k, v, t: paged_attention(q, k, v, t, kv_lens, config=cfg))

    kq, vq, scales = fp8_cache(kp, vp)

    def paged_fp8_with(cfg):
        return jax.jit(
            lambda q, k, v, t, ks, vs: paged_attention(
                q, k, v, t, kv_lens, k_scales=ks, v_scales=vs, config=cfg
            )
        )

    paged_fp8 = paged_fp8_with(None)
    fp8_args = (q, kq, vq, table, scales["k_scales"], scales["v_scales"])
    variants = {
        "cudnn": (
            jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
            (q, k, v),
        ),
        "ejk contiguous": (contiguous(None), (q, k, v)),
        "ejk flash_attention": (jax.jit(lambda q, k, v: flash_attention(q, k, v)), (q, k, v)),
        "ejk paged": (paged(None), (q, kp, vp, table)),
        "ejk paged fp8": (paged_fp8, fp8_args),
    }
    for label, cfg in configs.items():
        variants[f"ejk contiguous {label}"] = (contiguous(cfg), (q, k, v))
    for label, cfg in fp8_configs.items():
        variants[f"ejk paged fp8 {label}"] = (paged_fp8_with(cfg), fp8_args)
    # tokamax serves the contiguous call (its GPU kernels have no paged cache); a failure is
    # reported as a row error by `interleaved`, a missing tokamax leaves it out.
    tokamax_fns, why = _tokamax.candidates()
    if why:
        print(json.dumps(dict(bench="decode", impl="tokamax", skipped=why)), flush=True)
    for name, fn in tokamax_fns.items():
        variants[f"tokamax {name}"] = (jax.jit(fn), (q, k, v))
    timed = interleaved(variants, rounds)
    rows = []
    for name, (med, best, spread) in timed.items():
        fp8 = "fp8" in name
        row = dict(
            bench="decode", impl=name, B=B, S=S, N=N, K=K, H=H, ms=med * 1e3,
            best_ms=best * 1e3, spread=spread, gbps=_gbps(kv_bytes(B, S, K, H, fp8), med),
        )  # fmt: skip
        if name in timed and "cudnn" in timed:
            row["vs_cudnn"] = timed["cudnn"][0] / med
        if fp8 and "ejk paged" in timed:
            row["vs_bf16_paged"] = timed["ejk paged"][0] / med
        if name == "ejk paged fp8" and "ejk paged" in timed:
            ref = variants["ejk paged"][0](q, kp, vp, table).astype(jnp.float32)
            out = paged_fp8(*fp8_args).astype(jnp.float32)
            row["rel_err_vs_bf16"] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_ragged(rng, rounds: int, configs: dict) -> list[dict]:
    """8 prefill chunks of 512 tokens + 56 decode tokens over 4k contexts, paged (64), from a
    bf16 cache and an FP8 one: one ragged call against the prefill part and the decode part
    as two calls."""
    N, K, H, ctx = 32, 8, 128, 4096
    prefill, decode = 8, 56
    B = prefill + decode
    pps = ctx // PAGE
    keys = jax.random.split(jax.random.key(7), 3)
    kp = jax.random.normal(keys[0], (B * pps, PAGE, K, H), jnp.float32).astype(jnp.bfloat16)
    vp = jax.random.normal(keys[1], (B * pps, PAGE, K, H), jnp.float32).astype(jnp.bfloat16)
    table = jnp.asarray(rng.permutation(B * pps).reshape(B, pps), jnp.int32)
    kv_lens = jnp.full((B,), ctx, jnp.int32)
    q_lens = np.array([512] * prefill + [1] * decode)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    total = int(cu[-1])
    q = jax.random.normal(keys[2], (total, N, H), jnp.bfloat16)
    rows_prefill = prefill * 512
    q_pre = q[:rows_prefill].reshape(prefill, 512, N, H)
    q_dec = q[rows_prefill:].reshape(decode, 1, N, H)

    def mixed_call(cfg):
        return jax.jit(
            lambda q, kp, vp, t, c, scales: paged_attention(
                q, kp, vp, t, kv_lens, cu_q_lens=c, config=cfg, **scales
            )
        )

    part = jax.jit(lambda q, kp, vp, t, lens, scales: paged_attention(q, kp, vp, t, lens, **scales))

    @jax.jit
    def two_calls(qp, qd, kp, vp, t, scales):
        a = paged_attention(qp, kp, vp, t[:prefill], kv_lens[:prefill], **scales)
        b = paged_attention(qd, kp, vp, t[prefill:], kv_lens[prefill:], **scales)
        return a, b

    variants = {}
    # The bf16 cache and the FP8 one (e4m3 pages, a float32 scale per token and kv head).
    kq, vq, scales = fp8_cache(kp, vp)
    for suffix, (k_pool, v_pool, sc) in {"": (kp, vp, {}), " fp8": (kq, vq, scales)}.items():
        variants |= {
            f"ragged one call{suffix}": (mixed_call(None), (q, k_pool, v_pool, table, cu, sc)),
            f"prefill part{suffix}": (
                part, (q_pre, k_pool, v_pool, table[:prefill], kv_lens[:prefill], sc)
            ),
            f"decode part{suffix}": (
                part, (q_dec, k_pool, v_pool, table[prefill:], kv_lens[prefill:], sc)
            ),
            f"two calls{suffix}": (two_calls, (q_pre, q_dec, k_pool, v_pool, table, sc)),
        }  # fmt: skip
    for label, cfg in configs.items():
        variants[f"ragged one call {label}"] = (mixed_call(cfg), (q, kp, vp, table, cu, {}))
    timed = interleaved(variants, rounds)
    rows = []
    for name, (med, best, spread) in timed.items():
        fp8 = name.endswith("fp8")
        suffix = " fp8" if fp8 else ""
        parts = sum(timed.get(f"{p} part{suffix}", (np.nan,))[0] for p in ("prefill", "decode"))
        seqs = {f"prefill part{suffix}": prefill, f"decode part{suffix}": decode}.get(name, B)
        row = dict(
            bench="ragged", impl=name, ms=med * 1e3, best_ms=best * 1e3, spread=spread,
            gbps=_gbps(kv_bytes(seqs, ctx, K, H, fp8), med), vs_parts=med / parts,
        )  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def fp8_error(lengths=(512, 8192, 32768)) -> list[dict]:
    """The FP8 cache's output error against the bf16 cache's, in float32 arithmetic (no
    kernel: any platform), for inputs drawn in float32 then rounded to bf16 (zero mean) and
    drawn in bf16 directly (a mean near -0.01): e4m3's rounding moves each of k and v by
    about 2.5 % RMS, and the output by about 3.7 % at every length for zero-mean inputs; a
    biased draw's rounding offsets add up over S while random-key attention averages the
    values towards 0, so its error grows with S."""
    B, N, K, H = 2, 32, 8, 128
    rows = []
    for S in lengths:
        keys = jax.random.split(jax.random.key(S), 3)
        for draw in ("float32", "bfloat16"):
            q, k, v = (
                jax.random.normal(key, shape, jnp.dtype(draw)).astype(jnp.bfloat16)
                for key, shape in zip(keys, [(B, 1, N, H), (B, S, K, H), (B, S, K, H)], strict=True)
            )
            request = validate_paged_attention(
                q, k, v, jnp.arange(B, dtype=jnp.int32)[:, None], jnp.full((B,), S, jnp.int32)
            )
            ref = paged_reference_attention(request).astype(jnp.float32)
            (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
            out = paged_reference_attention(
                validate_paged_attention(
                    q, kq, vq, request.page_table, request.kv_lens, k_scales=ks, v_scales=vs
                )
            ).astype(jnp.float32)
            error = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            rows.append(dict(bench="fp8_error", S=S, drawn_in=draw, rel_err_vs_bf16=error))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def copy_ceiling() -> dict:
    """Device memory bandwidth of a plain read + write of 1 GiB (the decode ceiling)."""
    x = jax.random.normal(jax.random.key(1), (1 << 29,), jnp.bfloat16)
    fn = jax.jit(lambda x: x + 1)
    med, best, _ = interleaved({"copy": (fn, (x,))}, 5)["copy"]
    row = dict(bench="copy", gbps=_gbps(2 * x.nbytes, med), best_gbps=_gbps(2 * x.nbytes, best))
    print(json.dumps(row), flush=True)
    return row


def _config(splits, block_kv, warps, stages, block_m=16):
    return PagedConfig(
        block_m=block_m, block_kv=block_kv, num_splits=splits, num_warps=warps, num_stages=stages
    )


# Decode configs timed by --sweep on the contiguous cache: (splits, block_kv, warps, stages).
SWEEP = {
    f"s{s}-kv{b}-w{w}-st{st}": _config(s, b, w, st)
    for s, b, w, st in [
        (1, 64, 4, 3), (2, 64, 2, 3), (4, 64, 2, 3), (8, 64, 2, 3), (16, 64, 2, 3),
        (32, 64, 2, 3), (64, 64, 2, 3), (2, 64, 4, 2), (2, 32, 4, 4), (4, 128, 2, 2),
        (8, 128, 4, 2), (64, 128, 4, 2),
    ]
}  # fmt: skip
# FP8 paged decode configs timed by --fp8-sweep: (splits, block_kv, warps, stages); e4m3
# pages carry half the bytes of a bf16 block, so longer key blocks keep as many in flight.
FP8_SWEEP = {
    f"s{s}-kv{b}-w{w}-st{st}": _config(s, b, w, st)
    for s, b, w, st in [
        (2, 64, 4, 3), (2, 128, 4, 3), (2, 128, 4, 4), (2, 256, 4, 2), (2, 256, 8, 3),
        (4, 128, 4, 3), (1, 128, 4, 4), (4, 64, 4, 4), (8, 128, 4, 3), (16, 128, 4, 3),
        (2, 128, 8, 3), (4, 256, 4, 3),
    ]
}  # fmt: skip
# Ragged-call configs timed by --sweep: (block_m, block_kv, warps, stages), one split.
RAGGED_SWEEP = {
    f"m{m}-kv{b}-w{w}-st{st}": _config(1, b, w, st, block_m=m)
    for m, b, w, st in [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 4)]
}


def _table(rows):
    print(f"{'bench':8} {'impl':34} {'shape':>16} {'ms':>8} {'GB/s':>7} {'ratio':>6}")
    for r in rows:
        if r.get("bench") not in ("decode", "ragged"):
            continue
        shape = f"{r['B']}x{r['S']}" if "S" in r else ""
        ratio = r.get("vs_cudnn", r.get("vs_parts", float("nan")))
        print(
            f"{r['bench']:8} {r['impl']:34} {shape:>16} {r['ms']:8.3f} {r['gbps']:7.0f} {ratio:6.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP configs")
    parser.add_argument("--fp8-sweep", action="store_true", help="time the FP8_SWEEP configs")
    parser.add_argument("--no-ragged", action="store_true", help="leave out the ragged batch")
    parser.add_argument(
        "--fp8-error",
        action="store_true",
        help="only the FP8 cache's error (no kernel, any platform)",
    )
    parser.add_argument("--shapes", default="", help="comma-separated indices into DECODE_SHAPES")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument("--json", default="", help="write every row, device and versions here")
    parser.add_argument("--commit", default="", help="the commit under test (for the JSON)")
    args = parser.parse_args()
    if args.fp8_error:
        fp8_error()
        return 0
    rng = np.random.default_rng(0)
    wanted = [int(i) for i in args.shapes.split(",")] if args.shapes else range(len(DECODE_SHAPES))
    parts = [lambda: check_values(rng), lambda: [copy_ceiling()]]
    parts += [
        lambda i=i: bench_decode(
            rng,
            DECODE_SHAPES[i],
            args.rounds,
            SWEEP if args.sweep else {},
            FP8_SWEEP if args.fp8_sweep else {},
        )
        for i in wanted
    ]
    if not args.no_ragged:
        parts.append(lambda: bench_ragged(rng, args.rounds, RAGGED_SWEEP if args.sweep else {}))
    rows = []
    for part in parts:  # one failing part (out of memory, say) leaves the others' rows
        try:
            rows += part()
        except Exception as exc:
            rows.append(dict(error=f"{type(exc).__name__}: {str(exc)[:500]}"))
            print(json.dumps(rows[-1]), flush=True)
        if args.json:
            from gpu_conformance import run_info

            with open(args.json, "w") as f:
                json.dump({**run_info("bench_decode.py", args.commit), "rows": rows}, f, indent=1)
    _table(rows)
    failed = [r for r in rows if ("passed" in r and not r["passed"]) or "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
