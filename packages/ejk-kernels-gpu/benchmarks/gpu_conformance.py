"""bf16 conformance of ejk_kernels_gpu.flash_attention on a real GPU, at realistic sizes.

Compares outputs, lse and gradients (q, k, v, bias, sinks) with the float32
reference on the bf16 inputs upcast, by relative L2 error ``|x - ref| / |ref|``.
A case passes when every error is within `BF16_TOL`, no NaN appears, two runs are
equal (dq apart when atomic adds made it, which may reorder them), and the kernel
builds that ran are the ones the case is about: on Hopper a case that expects the
Gluon or warp-specialised build fails if another ran (a silent fallback), and one that
expects the ordinary kernels fails if a special build ran. The launches are recorded as
they are traced.

Cases ``len(CASES)`` onwards are the flex kernels' (`_flex_conformance.FLEX_CASES`: a user's
mask_mods and score_mods against flex attention's dense definition).

The result is written as JSON (``--json``): device, versions, commit, every case's
errors, determinism, builds and verdict. Commit it beside the code (benchmarks/results/).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/gpu_conformance.py [--quick] \
        [--json $OUT/conformance.json] [--commit SHA]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from _flex_conformance import FLEX_CASES, flex_case, relative_error

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention
from ejk_kernels_gpu.flash import _backward_launch, _forward_launch
from ejk_sequtils import random_document_ids, reference_attention

BF16_TOL = 2e-2  # bf16 operands: errors land between 1e-3 and 1e-2 (METHOD.md)
# The warp-specialised forward and backward, asked for explicitly (cases with ws=True,
# ws_bwd=True; on Hopper the heuristics pick them for unmasked and causal calls at H=128),
# and the ordinary kernels with the tiles they stand in for (ordinary=True).
WS = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, warp_specialize=True)
WS_BWD = FlashBackwardConfig(
    block_keys=128, block_queries=64, num_warps=4, num_stages=2, warp_specialize=True
)
# The Gluon forward (on Hopper the heuristic's pick at H=128, 16-bit, unmasked or causal),
# with the ring depth the heuristic does not take.
GLUON2 = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=2, gluon=True)
GLUON = FlashConfig(block_q=128, block_k=128, num_warps=4, num_stages=3, gluon=True)
ORDINARY = FlashConfig(block_q=128, block_k=128, num_warps=8, num_stages=3)
# The Gluon forward's three consumers (192-row tiles): the heuristic's for soft cap calls at
# head_dim 64 and 128 without a block table, asked for elsewhere.
THREE = FlashConfig(block_q=192, block_k=64, num_warps=4, num_stages=2, gluon=True)
ORDINARY_BWD = FlashBackwardConfig(
    block_keys=128, block_queries=64, num_warps=8, num_stages=3, atomic_dq=True
)


LAUNCHES: list[dict] = []


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


@contextlib.contextmanager
def _recording():
    """Record every kernel launch traced inside (kernel name and build flags)."""

    def spy(real):
        def launch(kernel, grid, inputs, out_shapes, constexprs, **kw):
            LAUNCHES.append(
                {
                    "kernel": _kernel_name(kernel),
                    "ws": bool(constexprs.get("WS", False)),
                    # dq added by atomics (ordinary dk/dv) or TMA reduces (Gluon dk/dv, DQ)
                    "atomic_dq": bool(
                        constexprs.get("DQ_ATOMIC", False) or constexprs.get("DQ", False)
                    ),
                    # the ordinary dk/dv kernel's dq added by TMA reduces (Hopper, atomic_dq,
                    # head_dim a power of two: `flash._constexprs.dq_by_tma`)
                    "dq_tma": bool(constexprs.get("DQ_TMA", False)),
                    "warps": kw.get("num_warps"),
                    "stages": kw.get("num_stages"),
                    # the Gluon forward's tile and whether it ran persistent
                    "rows": constexprs.get("BM"),
                    "persistent": constexprs.get("PERSISTENT"),
                }
            )
            return real(kernel, grid, inputs, out_shapes, constexprs, **kw)

        return launch

    saved = _forward_launch.launch, _backward_launch.launch
    _forward_launch.launch, _backward_launch.launch = spy(saved[0]), spy(saved[1])
    try:
        yield
    finally:
        _forward_launch.launch, _backward_launch.launch = saved


def _builds(launches: list[dict]) -> dict:
    """Which forward and backward builds the recorded launches were."""
    fwd = bwd = fwd_tile = None
    atomic_dq = any(launch["atomic_dq"] for launch in launches)
    dq_tma = any(launch["dq_tma"] for launch in launches)
    for launch in launches:
        if launch["kernel"] == "gluon_fwd_kernel":
            fwd = "gluon"
            fwd_tile = {"rows": launch["rows"], "persistent": launch["persistent"]}
        elif launch["kernel"] == "fwd_kernel":
            fwd = "ws" if launch["ws"] else "ordinary"
        elif launch["kernel"] in ("gluon_dkdv_kernel", "gluon_dkdv_wide_kernel"):
            bwd = "gluon"
        elif launch["kernel"] == "dkdv_kernel":
            bwd = "ws" if launch["ws"] else ("atomic" if launch["atomic_dq"] else "ordinary")
    return {"fwd": fwd, "bwd": bwd, "atomic_dq": atomic_dq, "dq_tma": dq_tma, "gluon_fwd": fwd_tile}


def _builds_ok(builds: dict, expect: dict, hopper: bool) -> bool:
    """Special builds (gluon, ws) ran exactly where expected (off Hopper: never)."""
    for part in ("fwd", "bwd"):
        want = expect.get(part, "ordinary") if hopper else "ordinary"
        got = builds.get(part)
        if got is None and part == "bwd" and expect.get("fwd_only"):
            continue
        special = want in ("gluon", "ws")
        if special and got != want:
            return False
        if not special and got in ("gluon", "ws"):
            return False
    if hopper and "dq_tma" in expect and builds.get("dq_tma") != expect["dq_tma"]:
        return False  # the TMA-reduce dq path (DQ_TMA) ran, or did not, against the case
    rows = expect.get("rows")  # the Gluon forward's tile, where the case is about it
    return not (hopper and rows and (builds.get("gluon_fwd") or {}).get("rows") != rows)


def _documents(rng, batch, length, repeat, padding=7):
    """Segment ids [batch, length]: documents 0, 1, ... of 100-400 tokens, ``padding``
    padding tokens (-1) at the end; ``repeat``: the last document reuses id 0 (a separate
    run)."""
    return random_document_ids(rng, batch, length, min_len=100, max_len=400, padding=padding,
                               repeat=repeat)  # fmt: skip


def _case(rng, name, B, T, S, N, K, H, expect, hopper, dtype=jnp.bfloat16, **kw):
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 8)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, K, H), dtype)
    v = jax.random.normal(keys[2], (B, S, K, H), dtype)
    d_out = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
    aligned = kw.pop("aligned", 0.0)
    if aligned:  # q = aligned · (-k of the same position): some logits far below -cap
        q = (q + aligned * -jnp.repeat(k[:, :T], N // K, axis=2)).astype(dtype)
    bias = sinks = None
    if kw.pop("bias", False):
        bias = jax.random.normal(keys[4], (1, N, T, S), dtype)
    huge = kw.pop("huge_bias", None)
    if huge is not None:  # a finite bias is a bias: whole rows and scattered entries
        bias = jax.random.normal(keys[4], (1, N, T, S), jnp.float32)
        bias = bias.at[:, :, 3].set(huge).at[:, 1, 5:400:7].set(huge).astype(dtype)
    num_sinks = kw.pop("sinks", 0)
    if num_sinks:
        shape = (N,) if num_sinks is True else (N, num_sinks)
        sinks = jax.random.normal(keys[5], shape, jnp.float32)
    if kw.pop("segments", False):  # ids from 0, -1 padding
        ids = jnp.sort(jax.random.randint(keys[6], (B, T), -1, 3), axis=1).astype(jnp.int32)
        kw["segment_ids"] = ids
    documents = kw.pop("documents", False)
    if documents:  # runs of 100-400 tokens (longer than the tiles), padding at the end
        # ("padded": 300 tokens of it, whole key blocks no row sees)
        padding = 300 if documents == "padded" else 7
        ids = _documents(rng, B, T, repeat=documents == "repeat", padding=padding)
        kw["segment_ids"] = jnp.asarray(ids)
    if kw.pop("packed", False):
        cuts = np.sort(rng.choice(np.arange(1, T), size=6, replace=False))
        cu = np.r_[0, cuts, cuts[-1], T - 5].astype(np.int32)  # one empty sequence, padding
        kw["cu_seqlens_q"] = jnp.asarray(cu)
    if kw.pop("ws", False):
        kw["config"] = WS
    if kw.pop("gluon2", False):
        kw["config"] = GLUON2
    if kw.pop("gluon", False):  # asked for where the heuristic does not take it (head_dim 64)
        kw["config"] = GLUON
    if kw.pop("three", False):
        kw["config"] = THREE
    if kw.pop("ws_bwd", False):
        kw["bwd_config"] = WS_BWD
    slots = kw.pop("gluon_bwd", 0)
    dq_inside = kw.pop("dq_inside", False)
    if slots:  # the Gluon dk/dv kernel asked for (this many ring slots; dq in it or not;
        # 64 resident keys at head_dim 256)
        kw["bwd_config"] = FlashBackwardConfig(
            block_keys=64 if H == 256 else 128, block_queries=64, num_warps=4, num_stages=slots,
            gluon=True, atomic_dq=dq_inside,
        )  # fmt: skip
    if kw.pop("ordinary", False):
        kw.update(config=ORDINARY, bwd_config=ORDINARY_BWD)
    if kw.pop("tma_dq", False):  # the ordinary dk/dv kernel with atomic dq (TMA reduces on Hopper)
        kw["bwd_config"] = ORDINARY_BWD
    ref_kw = {n: x for n, x in kw.items() if n not in ("config", "bwd_config")}

    def run(fn, q, k, v, bias, sinks):
        def loss(q, k, v, bias, sinks):
            out, lse = fn(q, k, v, bias, softmax_sinks=sinks, return_lse=True,
                          **(kw if fn is flash_attention else ref_kw))  # fmt: skip
            return jnp.sum(out.astype(jnp.float32) * d_out), (out, lse)

        argnums = tuple(i for i, x in enumerate((q, k, v, bias, sinks)) if x is not None)
        grad = jax.grad(loss, argnums=argnums, has_aux=True)
        return jax.jit(grad)(q, k, v, bias, sinks)

    f32 = lambda x: None if x is None else x.astype(jnp.float32)
    start = time.perf_counter()
    LAUNCHES.clear()
    with _recording():
        got_g, (got_o, got_l) = run(flash_attention, q, k, v, bias, sinks)
    builds = _builds(LAUNCHES)
    jax.block_until_ready(got_g)
    again_g, (again_o, again_l) = run(flash_attention, q, k, v, bias, sinks)
    ref_g, (ref_o, ref_l) = run(reference_attention, f32(q), f32(k), f32(v), f32(bias), sinks)
    seconds = time.perf_counter() - start
    errs = {"out": relative_error(got_o, ref_o), "lse": relative_error(got_l, ref_l)}
    names = [n for n, x in zip(("dq", "dk", "dv", "dbias", "dsinks"), (q, k, v, bias, sinks), strict=True) if x is not None]  # fmt: skip
    for n, g, r in zip(names, got_g, ref_g, strict=True):
        errs[n] = relative_error(g, r)
    nan = any(bool(jnp.any(jnp.isnan(jnp.asarray(x, jnp.float32)))) for x in (got_o, *got_g))
    same = {n: bool(jnp.all(a == b)) for n, a, b in zip(names, got_g, again_g, strict=True)}
    # dq from atomic adds or TMA reduces (FlashBackwardConfig.atomic_dq) may differ in its last
    # bits between runs.
    same["out"] = bool(jnp.all(got_o == again_o))
    same["lse"] = bool(jnp.all(got_l == again_l))
    differ = sorted(n for n, v in same.items() if not v)
    det = not [n for n in differ if n != "dq" or not builds["atomic_dq"]]
    builds_ok = _builds_ok(builds, expect, hopper)
    ok = not nan and det and builds_ok and max(errs.values()) <= BF16_TOL
    shape = f"B{B} T{T} S{S} N{N} K{K} H{H}"
    err_txt = " ".join(f"{n}={e:.1e}" for n, e in errs.items())
    print(
        f"{'PASS' if ok else 'FAIL'} {name:<24} {shape:<28} fwd={builds['fwd']} bwd={builds['bwd']}"
        f"{'' if builds_ok else ' (BUILD NOT AS EXPECTED)'} tile={builds['gluon_fwd']} det={det} dq_det={same['dq']} "
        f"{'differ=' + ','.join(differ) + ' ' if differ else ''}"
        f"nan={nan} {err_txt} ({seconds:.1f}s)"
    )
    return {
        "name": name, "shape": shape, "dtype": jnp.dtype(dtype).name, "errors": errs,
        "deterministic": det, "dq_deterministic": same["dq"], "differ_between_runs": differ,
        "nan": nan, "builds": builds,
        "expected_builds": expect if hopper else {}, "builds_ok": builds_ok, "passed": ok,
        "seconds": round(seconds, 1),
    }  # fmt: skip


def _forward_only(name, B, T, S, N, K, H, expect, hopper, sinks=False):
    """An undifferentiated call without lse: on Hopper, the Gluon forward at H=128."""
    keys = jax.random.split(jax.random.key(T + S + K), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, S, K, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, S, K, H), jnp.bfloat16)
    s = jax.random.normal(keys[3], (N,), jnp.float32) if sinks else None
    run = jax.jit(lambda q, k, v, s: flash_attention(q, k, v, softmax_sinks=s))
    LAUNCHES.clear()
    with _recording():
        got = run(q, k, v, s)
    builds = _builds(LAUNCHES)
    again = run(q, k, v, s)
    f32 = lambda x: x.astype(jnp.float32)
    ref = reference_attention(f32(q), f32(k), f32(v), softmax_sinks=s)
    err = relative_error(got, ref)
    det = bool(jnp.all(got == again))
    nan = bool(jnp.any(jnp.isnan(f32(got))))
    builds_ok = _builds_ok(builds, {**expect, "fwd_only": True}, hopper)
    ok = det and not nan and builds_ok and err <= BF16_TOL
    print(f"{'PASS' if ok else 'FAIL'} {name + ' (fwd only)':<24} B{B} T{T} S{S} N{N} K{K} H{H} "
          f"fwd={builds['fwd']} det={det} nan={nan} out={err:.1e}")  # fmt: skip
    return {
        "name": name + " (fwd only)", "shape": f"B{B} T{T} S{S} N{N} K{K} H{H}",
        "dtype": "bfloat16", "errors": {"out": err}, "deterministic": det, "nan": nan,
        "builds": builds, "expected_builds": expect if hopper else {}, "builds_ok": builds_ok,
        "passed": ok,
    }  # fmt: skip


def run_info(script: str, commit: str) -> dict:
    """What a GPU result's JSON starts with: the script and its arguments, the commit under
    test, the date, the device and the versions."""
    device = jax.devices()[0]
    return {
        "script": f"packages/ejk-kernels-gpu/benchmarks/{script}",
        "argv": sys.argv[1:],
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": getattr(device, "device_kind", str(device)),
        "versions": versions(),
    }


def versions() -> dict:
    found = {"python": platform.python_version()}
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", "jax-triton"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found


# Builds each case is about, on Hopper: "gluon" / "ws" must run, anything else means the
# ordinary kernels (atomic-dq or dq-kernel backward: reported, not asserted).
# The heuristics' choice at H=128, 16-bit, unmasked/causal: the Gluon forward and the
# ordinary backward (the warp-specialised dk/dv kernel has a race: asked for explicitly only).
GW = {"fwd": "gluon"}
GG = {"fwd": "gluon", "bwd": "gluon"}  # and the Gluon dk/dv kernel (head_dim 128, 16-bit)
G3 = {**GG, "rows": 192}  # with three consumers (192-row tiles)
G2 = {**GG, "rows": 128}
WF = {"fwd": "ws"}  # the warp-specialised forward asked for, the heuristic's backward
WG = {"fwd": "ws", "bwd": "gluon"}  # the same where the heuristic's backward is Gluon's
WW = {"fwd": "ws", "bwd": "ws"}  # both asked for
ORD = {}
TMA = {"dq_tma": True}  # dq added by the ordinary dk/dv kernel's TMA reduces (DQ_TMA)
CASES = [
    ("plain h128", 2, 1024, 1024, 16, 16, 128, GG, {}),
    ("causal gqa h128", 2, 2048, 2048, 16, 4, 128, GG, dict(causal=True)),
    ("causal h64 odd len", 2, 1000, 1000, 8, 8, 64, GW, dict(causal=True)),  # (the Gluon forward at 64)
    ("cross h256 T!=S", 1, 777, 1500, 8, 2, 256, GW, {}),
    ("window+cap+sinks h80", 2, 1024, 1024, 8, 2, 80, ORD, dict(sliding_window=(128, 32), logits_soft_cap=20.0, sinks=True)),
    ("bias h96", 1, 512, 640, 8, 8, 96, ORD, dict(bias=True)),
    ("segments h128", 2, 1024, 1024, 8, 8, 128, GG, dict(segments=True, causal=True)),
    # Documents as segment ids: blocks of other documents skipped, blocks inside one run
    # unmasked; an id that comes back in a later run keeps its span masked.
    ("documents causal gqa h128", 2, 2048, 2048, 8, 2, 128, GG, dict(documents=True, causal=True)),
    ("documents repeat fp16 h64", 2, 1024, 1024, 8, 8, 64, GW, dict(documents="repeat", dtype=jnp.float16, gluon=True)),
    ("packed causal h128", 1, 4096, 4096, 8, 2, 128, GG, dict(packed=True, causal=True)),
    ("dropout h64", 2, 1024, 1024, 8, 8, 64, ORD, dict(dropout_rate=0.1, dropout_seed=3)),
    # Fully visible, H=128, S % 128 == 0: the warp-specialised TMA forward;
    # T % 128 != 0 exercises TMA's zero fill and clipped stores, K < N the GQA offsets.
    ("ws gqa sinks h128", 2, 1000, 1024, 16, 4, 128, WF, dict(sinks=True, ws=True)),
    # The warp-specialised forward on causal calls (block-relative mask).
    ("ws causal gqa h128", 2, 2048, 2048, 16, 4, 128, WG, dict(causal=True, ws=True)),
    ("ws causal sinks T<S", 2, 1000, 1024, 8, 8, 128, WF, dict(causal=True, sinks=True, ws=True)),
    ("ws causal T>S", 1, 1536, 1024, 8, 2, 128, WG, dict(causal=True, ws=True)),
    # The warp-specialised backward (with the forward's build): unmasked MHA, causal GQA
    # with sinks and a query length off the tiles (padded lse rows).
    ("ws bwd plain h128", 2, 1024, 1024, 16, 16, 128, WW, dict(ws=True, ws_bwd=True)),
    ("ws bwd causal gqa sinks", 2, 1000, 1024, 16, 4, 128, WW, dict(causal=True, sinks=True, ws=True, ws_bwd=True)),
    # The ordinary kernels on the calls the heuristics give the special builds.
    # (Their backward adds dq by TMA reduces, DQ_TMA, which Triton's interpreter cannot run:
    # these cases and the next are that path's only check of values.)
    ("ordinary causal h128", 2, 2048, 2048, 16, 16, 128, TMA, dict(causal=True, ordinary=True)),
    ("ordinary plain h128", 2, 1024, 1024, 16, 16, 128, TMA, dict(ordinary=True)),
    # DQ_TMA with groups (each query head's columns of the [T, N·H] descriptor), rows off
    # the tile (reduces clipped past T), head_dim 64, the heuristic's forward.
    ("ordinary dq TMA gqa odd T h64", 2, 1000, 1024, 8, 2, 64, {**TMA, "fwd": "gluon"}, dict(causal=True, tma_dq=True)),
    # The Gluon forward: causal with T > S and T < S (rows past the diagonal, clipped
    # stores), GQA, sinks, two ring slots.
    ("gluon causal gqa T>S", 1, 1536, 1024, 8, 2, 128, GG, dict(causal=True)),
    ("gluon causal sinks T<S", 2, 1000, 2048, 8, 8, 128, GW, dict(causal=True, sinks=True)),
    ("gluon2 plain gqa", 2, 1024, 2048, 16, 4, 128, GG, dict(gluon2=True)),
    # Decoding shapes: one query row (the rest of the tile zero-filled), one key block.
    ("gluon decode T=1", 2, 1, 4096, 8, 2, 128, GW, {}),
    ("gluon causal T=1 S=128", 2, 1, 128, 8, 8, 128, GW, dict(causal=True, sinks=True)),
    # float16 takes the special builds too (16-bit inputs).
    ("fp16 causal gqa h128", 2, 2048, 2048, 16, 4, 128, GG, dict(causal=True, dtype=jnp.float16)),
    ("fp16 plain h128 T!=S", 2, 1000, 1024, 8, 8, 128, GW, dict(dtype=jnp.float16, sinks=True)),
    # The definition's edge cases: a finite bias, however large, is a bias (whole rows
    # of -1e30 are a uniform softmax); several sinks per head fold by logsumexp.
    ("bias -1e30 rows h128", 1, 512, 640, 8, 8, 128, ORD, dict(huge_bias=-1e30, causal=True)),
    ("sinks [N,3] gqa h128", 2, 1024, 1024, 16, 4, 128, GG, dict(sinks=3, causal=True)),
    # The Gluon forward's masks (block tables, masks per score in the edge blocks), soft cap
    # (tanh.approx) and its head_dim 64 / 256 tiles.
    ("gluon window gqa h128", 2, 2048, 2048, 16, 4, 128, GG, dict(causal=True, sliding_window=(256, 0))),
    ("gluon window 2-sided T!=S h64", 1, 1000, 1500, 8, 8, 64, GW, dict(sliding_window=(100, 50), gluon=True)),
    ("gluon softcap causal sinks", 2, 2048, 2048, 16, 4, 128, G3, dict(causal=True, logits_soft_cap=30.0, sinks=True)),
    ("gluon h256 causal gqa", 2, 1024, 1024, 8, 2, 256, GG, dict(causal=True)),
    ("gluon h256 window cap fp16", 1, 1000, 1000, 8, 4, 256, GW, dict(causal=True, sliding_window=(300, 0), logits_soft_cap=20.0, dtype=jnp.float16)),
    ("gluon keys off tile h128", 2, 1000, 1000, 8, 2, 128, GW, dict(sinks=True)),
    # (GQA at head_dim 64: the heuristic's backward is the Gluon dk/dv kernel since ca1355f.)
    ("gluon packed window h64", 1, 4096, 4096, 8, 2, 64, GG, dict(packed=True, causal=True, sliding_window=(200, 0), gluon=True)),
    ("gluon documents softcap h128", 2, 2048, 2048, 8, 2, 128, GG, dict(documents=True, causal=True, logits_soft_cap=30.0)),
    # The Gluon dk/dv kernel: keys off its 128-key tile (zero-filled, clipped stores) with
    # sinks, head_dim 64 asked for (MHA: not the heuristic's there), three ring slots, fp16 T>S.
    ("gluon bwd keys off tile sinks", 2, 1024, 1000, 8, 2, 128, GG, dict(sinks=True)),
    ("gluon bwd causal h64", 2, 2048, 2048, 8, 2, 64, GG, dict(causal=True, gluon_bwd=2)),
    ("gluon bwd 3 slots mha", 2, 1024, 1024, 8, 8, 128, GG, dict(causal=True, gluon_bwd=3)),
    ("gluon bwd fp16 causal T>S", 1, 1536, 1000, 8, 4, 128, GG, dict(causal=True, dtype=jnp.float16)),
    ("gluon bwd softcap fp16 mha", 2, 1024, 1024, 8, 8, 128, G3, dict(causal=True, logits_soft_cap=20.0, dtype=jnp.float16)),
    # dq in the Gluon dk/dv kernel (TMA reduces): the heuristic's for MHA (causal T>S with
    # sinks, fp16 keys off the tile), and asked for with groups, two slots and a soft cap.
    ("gluon dq inside causal T>S sinks", 1, 1536, 1000, 8, 8, 128, GG, dict(causal=True, sinks=True)),
    ("gluon dq inside fp16 keys off tile", 2, 1024, 1000, 8, 8, 128, GG, dict(dtype=jnp.float16)),
    ("gluon dq inside gqa cap 2 slots", 2, 1024, 1024, 16, 4, 128, G3, dict(causal=True, logits_soft_cap=20.0, gluon_bwd=2, dq_inside=True)),
    # The Gluon forward's soft cap with a fixed shift (cap <= 54, no sinks) where logits
    # reach -cap (q against -k of its own position; causal rows with few keys), and above
    # that cap with the running max.
    ("gluon softcap 50 logits at -cap", 2, 1024, 1024, 8, 8, 128, G3, dict(causal=True, logits_soft_cap=50.0, aligned=8.0)),
    ("gluon softcap 60 gqa", 2, 1024, 1024, 16, 4, 128, G3, dict(logits_soft_cap=60.0)),
    # The Gluon dk/dv kernel on the dk/dv block table (windows, packing, segment ids):
    # with dq inside (MHA) and beside it (the ordinary dq kernel, GQA), keys off the tile.
    ("gluon bwd packed window mha", 1, 4096, 4096, 8, 8, 128, GG, dict(packed=True, causal=True, sliding_window=(300, 0))),
    ("gluon bwd documents repeat fp16 mha", 2, 2048, 2048, 8, 8, 128, GG, dict(documents="repeat", dtype=jnp.float16)),
    ("gluon bwd window 2-sided gqa S!=T", 2, 1024, 1000, 16, 4, 128, GG, dict(sliding_window=(100, 50), sinks=True)),
    # head_dim 256: the column-split Gluon dk/dv kernel (64 resident keys), the Gluon dq
    # kernel beside it (32 keys a step).
    ("gluon bwd h256 causal gqa", 2, 2048, 2048, 16, 8, 256, GG, dict(causal=True)),
    ("gluon bwd h256 documents fp16", 2, 1024, 1024, 8, 4, 256, GG, dict(documents=True, dtype=jnp.float16)),
    ("gluon bwd h256 window softcap sinks", 1, 2048, 2048, 8, 8, 256, GG, dict(causal=True, sliding_window=(300, 0), logits_soft_cap=20.0, sinks=True)),
    # Keys no query row sees (causal, S > T): the Gluon dk/dv programs that visit no query
    # block store zeros and end first (`store_zero_dkdv`), at head_dim 128 (dq inside) and 256.
    ("gluon bwd causal keys past the rows mha", 2, 1024, 2048, 8, 8, 128, GG, dict(causal=True)),
    ("gluon bwd h256 causal keys past the rows", 1, 1024, 2048, 8, 4, 256, GG, dict(causal=True)),
    # Key blocks of padding alone (300 tokens at the end): by the block table no query block
    # sees them, and their Gluon dk/dv programs store zeros and end first (`store_zero_dkdv`).
    ("gluon bwd documents padded tail h128", 2, 1024, 1024, 8, 2, 128, GG, dict(documents="padded", causal=True)),
    ("gluon bwd h256 documents padded tail fp16", 2, 1024, 1024, 8, 4, 256, GG, dict(documents="padded", dtype=jnp.float16)),
    # 32 (batch, head) groups of 64 query blocks: the persistent forward takes the last 9
    # rows-major, the first 23 in the grid's order (`flash._constexprs.rows_major`)
    ("gluon causal last groups rows-major", 1, 8192, 8192, 32, 8, 128, GG, dict(causal=True)),
    # head_dim 64 by the heuristics: the Gluon dk/dv kernel with groups or a soft cap, the
    # ordinary dq kernel beside it (64x32 tiles, its own dq block table) without a cap
    # (`flash._select.DQ_RULES`), the Gluon one with; windows keep the ordinary forward.
    ("gluon bwd h64 gqa causal T>S sinks", 1, 1536, 1000, 16, 4, 64, GG, dict(causal=True, sinks=True)),
    ("gluon bwd h64 gqa documents fp16", 2, 2048, 2048, 8, 2, 64, GG, dict(documents=True, causal=True, dtype=jnp.float16)),
    ("gluon bwd h64 gqa window 2-sided", 1, 2048, 2048, 16, 4, 64, {"bwd": "gluon"}, dict(sliding_window=(300, 100))),
    ("gluon bwd h64 mha softcap keys off tile", 2, 1024, 1000, 8, 8, 64, G3, dict(causal=True, logits_soft_cap=20.0)),
    # Three consumers (192-row tiles, 64 keys a step): the heuristic's with a soft cap, T off
    # the tile on whole 64-row steps (persistent: the last tile's consumers past T compute
    # nothing, `_release_tile`), T on no step (one program a tile), keys off the tile, fp16
    # (no fixed shift) with sinks; asked for with documents, a window, no cap, head_dim 64.
    ("gluon3 softcap causal gqa T%192=64", 2, 1024, 1024, 16, 4, 128, G3, dict(causal=True, logits_soft_cap=50.0)),
    ("gluon3 softcap plain odd T", 2, 1000, 1024, 8, 8, 128, {**GW, "rows": 192}, dict(logits_soft_cap=30.0)),
    ("gluon3 softcap fp16 sinks T>S", 1, 1536, 1000, 8, 2, 128, G3, dict(causal=True, logits_soft_cap=20.0, sinks=True, dtype=jnp.float16)),
    ("gluon3 documents softcap", 2, 2048, 2048, 8, 2, 128, G3, dict(documents=True, causal=True, logits_soft_cap=30.0, three=True)),
    ("gluon3 window gqa no cap", 2, 2048, 2048, 16, 4, 128, G3, dict(causal=True, sliding_window=(256, 0), three=True)),
    ("gluon3 h64 softcap causal", 2, 2048, 2048, 8, 8, 64, G3, dict(causal=True, logits_soft_cap=20.0, three=True)),
    # Two consumers with T off the tile on whole 64-row steps (persistent, one idle consumer).
    ("gluon causal T%128=64", 2, 1088, 1152, 8, 2, 128, G2, dict(causal=True)),
]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", default="", help="comma-separated case indices")
    parser.add_argument("--json", default="", help="write the result as JSON here")
    parser.add_argument("--commit", default="", help="the commit under test (for the JSON)")
    parser.add_argument("--repeat", type=int, default=1, help="run each picked case this often")
    parser.add_argument(
        "--shards", type=int, default=1,
        help="run the picked cases in this many processes at once, merged into one --json",
    )  # fmt: skip
    args = parser.parse_args()
    _without_gemm_autotuning()
    if args.shards > 1:
        return _run_shards(args)
    from ejk_kernels_gpu.build._triton import hopper_gpu

    hopper = hopper_gpu()
    device = jax.devices()[0]
    print(device, versions(), "hopper (Gluon and warp-specialised builds):", hopper)
    rng = np.random.default_rng(0)
    picked = _picked(args)
    rows: list[dict] = []

    def record(row: dict) -> None:
        """Keep ``row`` and rewrite the JSON, so a run cut short still leaves its cases."""
        rows.append(row)
        if args.json:
            result = {
                **run_info("gpu_conformance.py", args.commit),
                "platform": device.platform,
                "hopper": hopper,
                "tolerance": BF16_TOL,
                "passed": all(r["passed"] for r in rows),
                "cases": rows,
            }
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    if not args.cases or 0 in picked:  # the forward-only checks go with case 0
        record(_forward_only("plain h128", 2, 1024, 1024, 16, 16, 128, GW, hopper))
        record(_forward_only("gqa sinks h128 odd T", 2, 1000, 1024, 16, 4, 128, GW, hopper, sinks=True))  # fmt: skip
    for index in picked:
        case = _case_at(index)
        name = case[0]
        try:
            if index < len(CASES):
                _, B, T, S, N, K, H, expect, kw = case
                row = _case(rng, name, B, T, S, N, K, H, expect, hopper, **kw)
            else:
                row = flex_case(rng, *case, tol=BF16_TOL)
            record({"index": index, **row})
        except Exception as exc:  # report every case
            error = f"{type(exc).__name__}: {exc}"[:1500]
            record({"index": index, "name": name, "passed": False, "error": error})
            print(f"ERROR {name}: {rows[-1]['error']}")
    ok = all(row["passed"] for row in rows)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


def _without_gemm_autotuning() -> None:
    """Turn XLA's GEMM autotuning off (for this process and the shards it starts) before
    the backend starts: the float32 reference's products are compared, not timed, so
    autotuning them is compile work the check does not need, and compiling is what bounds
    a run (load 40-54 on 16 cores with the GPU idle,
    results/2026-12-07-h100-conformance-d927b45.json; the saving is not yet measured)."""
    flag = "--xla_gpu_autotune_level=0"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_autotune_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


# A case whose float32 reference scores (B·N·T·S) take more than this runs after the shards,
# alone: beside five other shards on one 80 GB GPU the T = 8192 case ran out of memory.
ALONE_BYTES = 1 << 31


def _case_at(index: int) -> tuple:
    """Case ``index``: `CASES`, then the flex kernels' `FLEX_CASES`."""
    return CASES[index] if index < len(CASES) else FLEX_CASES[index - len(CASES)]


def _alone(index: int) -> bool:
    _, batch, q_len, kv_len, heads, *_ = _case_at(index)
    return batch * heads * q_len * kv_len * 4 > ALONE_BYTES


def _picked(args: argparse.Namespace) -> list[int]:
    """Indices into `CASES` of the cases ``--quick``/``--cases``/``--repeat`` pick."""
    if args.cases:
        return [int(i) for i in args.cases.split(",")] * args.repeat
    return list(range(3 if args.quick else len(CASES) + len(FLEX_CASES)))


def _run_shards(args: argparse.Namespace) -> int:
    """The picked cases in ``--shards`` processes at once (case i in shard i mod shards; a
    case whose reference needs more memory than `ALONE_BYTES` afterwards, alone), each
    writing its own JSON as it goes, merged into ``--json`` every few seconds and at
    the end (cases in index order, each shard's command and exit status, the cases
    missing), so a call cut short still leaves every case that finished, in one file."""
    import subprocess
    import tempfile

    picked = _picked(args)
    shared = [i for i in picked if not _alone(i)]
    with tempfile.TemporaryDirectory() as where:
        shards: list = []

        def start(part: list[int]) -> None:
            out = f"{where}/shard{len(shards)}.json"
            command = [sys.executable, __file__, "--cases", ",".join(map(str, part)),
                       "--json", out, "--commit", args.commit]  # fmt: skip
            shards.append((out, command, subprocess.Popen(command)))

        def wait() -> None:
            while any(proc.poll() is None for *_, proc in shards):
                _merge_shards(args, picked, shards)
                time.sleep(5)

        for part in (shared[k :: args.shards] for k in range(args.shards)):
            if part:
                start(part)
        for index in (i for i in picked if _alone(i)):  # after the others, one at a time
            wait()
            start([index])
        wait()
        result = _merge_shards(args, picked, shards)
    ok = result["passed"] and not result["missing"]
    print("ALL PASS" if ok else f"SOME FAILED OR MISSING {result['missing']}")
    return 0 if ok else 1


def _merge_shards(args: argparse.Namespace, picked: list[int], shards: list) -> dict:
    """The shards' JSONs so far as one result (written to ``--json``): ``shards`` holds
    each one's ``(json path, command, process)``; a shard that wrote nothing yet has no
    cases."""
    header: dict = {}
    rows: list[dict] = []
    runs = []
    for out, command, proc in shards:
        try:
            with open(out) as f:
                part = json.load(f)
        except (OSError, ValueError):  # nothing written yet (or killed before a case)
            part = {"cases": []}
        header = header or {k: v for k, v in part.items() if k not in ("cases", "argv")}
        rows += part["cases"]
        runs.append({"argv": command[2:], "exit": proc.poll(), "cases": len(part["cases"])})
    rows.sort(key=lambda r: -1 if r.get("index") is None else r["index"])
    result = {**header, "argv": sys.argv[1:], "shards": runs, "cases": rows,
              "passed": bool(rows) and all(r["passed"] for r in rows),
              "missing": sorted(set(picked) - {r.get("index") for r in rows})}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
