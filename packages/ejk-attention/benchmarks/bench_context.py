"""Context parallelism on one GPU: the work one device of a zigzag ring does, against the
unsharded kernel on the whole sequence (issue 19's one-GPU target).

A device of an n-way ring runs n steps: its own block (causal on local indices) and n - 1
blocks of other devices (plain non-causal calls, see `_context_plan`); with all-gather it
runs one call of its two chunks against the whole sequence (`_context_gathered`). Here the
blocks of every device are stacked on one GPU and `device_forward` / `device_backward`
run exactly the steps device ``d`` would (its index passed as a traced argument, so the
``lax.switch`` of each step is taken at run time as on the ring), back to back in one jit,
without the transfers. Target: time(device) <= 1.1 * time(unsharded) / n.

Each row has two times. ``ms``: wall time per call over ``--reps`` calls with one sync, as
a model's step sees it; with short calls (a device's share of a call with documents takes
0.3 ms) the latency before the first call's first kernel weighs on it (one H200, T = 32768,
16 documents, n = 4: forward 1.35x the share at 10 calls, 1.14x at 40). ``gpu_ms``: the GPU's
span per call over ``--trace-calls`` calls back to back in a profiler trace, first kernel's
start to last kernel's end (the gaps between kernels within and between calls included, the
host's lead before the first not): the device's work, which the target's ratio is read on
(``gpu_ratio_to_ideal``). One trace a round, interleaved with the other rows' as the
wall-clock rounds are: the median round's span, every round's in ``gpu_ms_rounds``, and
that round's longest kernels in ``gpu_kernels_ms`` (since the twenty-fourth session; before,
one trace after the rounds). A device's rows run ``n`` times as many calls as the unsharded
one, so that both keep the GPU busy about as long: under sustained load the card can slow
(one H200: the unsharded f+b at T = 32768 took 5.24 ms a call over 10 calls, 5.50 by the
slope to 40; in one run the forward at T = 65536 took 4.09 ms a call over 20 traced calls
against 3.93 over 10 by the wall clock), which would flatter the shorter calls. Runs before
2026-11-28's twenty-third session report ``ms`` only.

``gpu_call_ms`` (since 2026-11-29's twenty-seventh session): in the same traces, each call's
own span, its first kernel's start to its last one's end (every call runs the same kernels
one after the other, `_trace._call_spans` of ejk-kernels-gpu's benchmarks), the median over
the calls and then over the rounds, and
``gpu_call_ratio_to_ideal`` on it. It is ``gpu_ms`` without the GPU's wait between two
calls of the jitted function (5-6 us on an H200, a cost of calling the benchmark's jit
over and over, not of the work: inside a model's step the kernels follow other work),
which ``gpu_ms`` charges a device's row n times against the unsharded row's once. The
target reads "its step kernels ... run back to back in one jit" against "the unsharded
kernel's time"; both ratios are reported.

``--check`` first compares, at a small size, every device's outputs and gradients
(assembled over the devices and laid back out of the zigzag) with the float32 reference.

``--layout contiguous``: the facade's layout for packed documents shorter than a shard
(`_context_sharding`): queries and keys in the contiguous split, all-gather running the
own block first and gathering k and v as one array (`_context_gathered`). Issue 19's
target is stated for the zigzag layout (the default).

Usage (GPU):  python packages/ejk-attention/benchmarks/bench_context.py --out bench.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_KERNEL_BENCH = Path(__file__).resolve().parents[2] / "ejk-kernels-gpu" / "benchmarks"
sys.path.insert(0, str(_KERNEL_BENCH))

from _timing import seconds_per_call  # noqa: E402
from _trace import gpu_span_ms  # noqa: E402
from gpu_conformance import run_info  # noqa: E402

from ejk_attention._context_calls import CallMasks  # noqa: E402
from ejk_attention._ring import Placement, _Ring, device_backward, device_forward  # noqa: E402
from ejk_sequtils import attention_tolerance, from_zigzag, reference_attention, to_zigzag  # noqa: E402

N, K, H = 32, 8, 128
DOCS = 16


def _inputs(t: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    make = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    return make(1, t, N, H), make(1, t, K, H), make(1, t, K, H), make(1, t, N, H)


def _documents(t: int) -> jax.Array:
    return jnp.asarray(np.repeat(np.arange(DOCS), t // DOCS)[None], jnp.int32)


def _keys_zigzag(strategy: str, layout: str = "zigzag") -> bool:
    """The facade's key layout: all-gather's one call keeps keys in the contiguous split."""
    return strategy != "all_gather" and layout == "zigzag"


def _options(strategy: str, kernels: bool = True, layout: str = "zigzag") -> _Ring:
    masks = CallMasks(scale=H**-0.5, causal=True, window=None, soft_cap=None, kernels=kernels)
    zigzag = layout == "zigzag"
    kv_zigzag = None if _keys_zigzag(strategy, layout) or not zigzag else False
    return _Ring(axis_name=None, masks=masks, strategy=strategy, zigzag=zigzag, kv_zigzag=kv_zigzag)


def _blocks(x: jax.Array | None, n: int, zigzag: bool = True):
    """Zigzag layout (or the contiguous split), then the n device blocks stacked:
    ``[n, B, T / n, ...]``."""
    if x is None:
        return None
    z = to_zigzag(x, n) if zigzag else x
    return jnp.stack(jnp.split(z, n, axis=1))


def _device_blocks(strategy: str, n: int, q, k, v, ids, d_out, layout: str = "zigzag") -> dict:
    """Every device's blocks as the facade lays them out for ``strategy``: queries (and
    their ids, d_out) zigzag (or contiguous); keys, values and kv ids zigzag or contiguous,
    and gathered as the forward gathers them (all-gather's one call with documents: k and
    v as one array, `gathers_kv_pair`)."""
    kz = _keys_zigzag(strategy, layout)
    qz = layout == "zigzag"
    kv = tuple(_blocks(x, n, kz) for x in (k, v, ids))
    gathered = kv
    if strategy == "all_gather" and ids is not None:
        gathered = (_blocks(jnp.concatenate([k, v], axis=-1), n, kz), None, kv[2])
    return {
        "q": _blocks(q, n, qz),
        "q_ids": _blocks(ids, n, qz),
        "d_out": _blocks(d_out, n, qz),
        "kv": kv,
        "gathered": gathered,
    }


def _own(blocks: dict, d: int) -> tuple:
    """Device d's ``(q, k, v, q_ids, kv_ids)`` out of the stacked blocks, each an array
    of its own."""
    k, v, kv_ids = blocks["kv"]
    parts = (blocks["q"], k, v, blocks["q_ids"], kv_ids)
    return tuple(None if x is None else jnp.array(x[d]) for x in parts)


def device_work(n: int, d: int, with_bwd: bool, strategy: str, layout: str = "zigzag"):
    """The jitted work of device ``d`` of an n-way zigzag layout (``me`` traced): the
    ring's steps, or all-gather's one call against the whole sequence. Called with the
    device's own blocks ``(q, k, v, q_ids, kv_ids)`` as arrays of their own (as a device
    holds them; slicing them out of the stack inside would time a copy no device makes),
    every device's ``(k, v, kv_ids)`` stacked, ``me`` and, with the backward, the
    device's d_out."""
    st = _options(strategy, layout=layout)

    def fwd(own, gathered, me):
        q, k, v, q_ids, kv_ids = own
        where = Placement(me=me, size=n, gathered=gathered)
        return device_forward(st, q, k, v, q_ids, kv_ids, where)

    def fwd_bwd(own, gathered, me, d_out):
        out, lse = fwd(own, gathered, me)
        q, k, v, q_ids, kv_ids = own
        where = Placement(me=me, size=n, gathered=gathered)
        res = (q, k, v, q_ids, kv_ids, out, lse)
        dq, dk, dv = device_backward(st, res, (d_out, jnp.zeros_like(lse)), where)
        if strategy == "all_gather":  # what its one reduce-scatter takes: the array the
            # kernel wrote dk and dv into, side by side (joined again for free)
            return dq, jnp.concatenate([dk, dv], axis=-1)
        return dq, dk, dv

    return jax.jit(fwd_bwd if with_bwd else fwd)


def unsharded(with_bwd: bool):
    from ejk_kernels_gpu import flash_attention

    def fwd(q, k, v, ids):
        return flash_attention(q, k, v, causal=True, segment_ids=ids)

    def fwd_bwd(q, k, v, ids, d_out):
        out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, ids), q, k, v)
        return out, vjp(d_out)

    return jax.jit(fwd_bwd if with_bwd else fwd)


def check(
    t: int, n: int, with_docs: bool, strategy: str, dtype=jnp.bfloat16, layout: str = "zigzag"
) -> dict:
    """Every device's work assembled against the float32 reference: max relative errors."""
    q, k, v, d_out = _inputs(t, dtype, seed=1)
    ids = _documents(t) if with_docs else None
    blocks = _device_blocks(strategy, n, q, k, v, ids, d_out, layout)
    outs, lses, dqs = [], [], []
    dk = dv = 0.0
    for d in range(n):
        own = _own(blocks, d)
        out, lse = device_work(n, d, False, strategy, layout)(own, blocks["gathered"], jnp.int32(d))
        dq, *dkv = device_work(n, d, True, strategy, layout)(
            own, blocks["gathered"], jnp.int32(d), blocks["d_out"][d]
        )
        dk_d, dv_d = jnp.split(dkv[0], 2, axis=-1) if len(dkv) == 1 else dkv
        outs.append(out)
        lses.append(lse)
        dqs.append(dq)
        dk, dv = dk + dk_d, dv + dv_d
    joined = lambda parts, axis=1: jnp.concatenate(parts, axis)
    unlay = joined
    if layout == "zigzag":
        unlay = lambda parts, axis=1: from_zigzag(joined(parts, axis), n, axis=axis)
    unlay_kv = unlay if _keys_zigzag(strategy, layout) else joined
    got = {
        "out": unlay(outs),
        "lse": unlay(lses, 2),
        "dq": unlay(dqs),
        "dk": unlay_kv(list(dk)),
        "dv": unlay_kv(list(dv)),
    }
    f32 = lambda x: x.astype(jnp.float32)

    def ref(q, k, v):
        return reference_attention(q, k, v, causal=True, segment_ids=ids, return_lse=True)

    (want_out, want_lse), vjp = jax.vjp(ref, f32(q), f32(k), f32(v))
    dq_w, dk_w, dv_w = vjp((f32(d_out), jnp.zeros_like(want_lse)))
    want = {"out": want_out, "lse": want_lse, "dq": dq_w, "dk": dk_w, "dv": dv_w}
    row = {"t": t, "n": n, "docs": with_docs, "strategy": strategy, "layout": layout}
    row["dtype"] = jnp.dtype(dtype).name
    ok = True
    for name, w in want.items():
        g = f32(got[name])
        err = float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-30))
        row[f"{name}_rel_err"] = err
        quantity = "out" if name == "out" else "lse" if name == "lse" else "grad"
        ok &= err <= attention_tolerance(dtype, quantity)
    row["passed"] = bool(ok)
    return row


def bench(
    t: int,
    ns: tuple[int, ...],
    with_docs: bool,
    strategies: tuple[str, ...],
    rounds: int,
    reps: int,
    layout: str = "zigzag",
    trace_calls: int = 20,
) -> list[dict]:
    q, k, v, d_out = _inputs(t, jnp.bfloat16)
    ids = _documents(t) if with_docs else None
    contenders = []
    for with_bwd in (False, True):
        args = (q, k, v, ids, *((d_out,) if with_bwd else ()))
        contenders.append(
            ({"impl": "unsharded", "n": 1, "bwd": with_bwd}, unsharded(with_bwd), args)
        )
        for n in ns:
            for strategy in strategies:
                blocks = _device_blocks(strategy, n, q, k, v, ids, d_out, layout)
                for d in sorted({0, n - 1}):
                    cot = (blocks["d_out"][d],) if with_bwd else ()
                    args = (_own(blocks, d), blocks["gathered"], jnp.int32(d), *cot)
                    row = {"impl": strategy, "n": n, "device": d, "bwd": with_bwd}
                    work = device_work(n, d, with_bwd, strategy, layout)
                    contenders.append((row, work, args))
    for _, fn, args in contenders:  # compile and warm up
        jax.block_until_ready(fn(*args))
    times = [[] for _ in contenders]
    spans = [[] for _ in contenders]  # (span, busy, kernels, call span) of each round's trace
    for _ in range(rounds):
        for i, (row, fn, args) in enumerate(contenders):
            times[i].append(seconds_per_call(fn, *args, reps=reps))
            if trace_calls:  # (n times the calls: as long busy as the unsharded call's)
                spans[i].append(gpu_span_ms(fn, args, trace_calls * row["n"]))
    rows = []
    for (row, _, _), ts, sp in zip(contenders, times, spans, strict=True):
        span = busy = kernels = call = None
        if sp:  # the median round's (the upper middle of an even count)
            span, busy, kernels, _ = sorted(sp, key=lambda x: x[0])[len(sp) // 2]
            call = sorted(x[3] for x in sp)[len(sp) // 2]  # (rounds' medians of their calls)
        rows.append(
            dict(row, t=t, docs=with_docs, layout=layout, ms=float(np.median(ts)) * 1e3,
                 gpu_ms=span, gpu_busy_ms=busy, gpu_ms_rounds=[x[0] for x in sp],
                 gpu_call_ms=call, gpu_call_ms_rounds=[x[3] for x in sp],
                 gpu_kernels_ms=kernels)
        )  # fmt: skip
    for row in rows:
        base = next(r for r in rows if r["impl"] == "unsharded" and r["bwd"] == row["bwd"])
        row["ratio_to_ideal"] = row["ms"] / (base["ms"] / row["n"])
        if trace_calls:
            row["gpu_ratio_to_ideal"] = row["gpu_ms"] / (base["gpu_ms"] / row["n"])
            row["gpu_call_ratio_to_ideal"] = row["gpu_call_ms"] / (base["gpu_call_ms"] / row["n"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--ring", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--strategy", nargs="+", choices=("ring", "all_gather"), default=["ring", "all_gather"]
    )
    parser.add_argument(
        "--trace-calls",
        type=int,
        default=20,
        help="unsharded calls per trace for gpu_ms, n times as many for n devices (0: none)",
    )
    parser.add_argument("--check", action="store_true", help="check numerics first")
    parser.add_argument(
        "--documents", choices=("both", "no", "yes"), default="both", help="16 packed documents"
    )
    parser.add_argument(
        "--layout",
        choices=("zigzag", "contiguous"),
        default="zigzag",
        help="the queries' split (contiguous: the facade's for short documents)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    commit = (
        os.environ.get("EJK_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    )
    result = {
        **run_info("../../ejk-attention/benchmarks/bench_context.py", commit),
        "shape": {
            "B": 1,
            "N": N,
            "K": K,
            "H": H,
            "dtype": "bfloat16",
            "causal": True,
            "documents": DOCS,
        },
        "checks": [],
        "rows": [],
    }

    def save() -> None:
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1))

    if args.check:
        for with_docs, n, strategy in itertools.product((False, True), (2, 4), args.strategy):
            row = check(2048, n, with_docs, strategy, layout=args.layout)
            print("check", row, flush=True)
            result["checks"].append(row)
            save()
    docs = {"both": (False, True), "no": (False,), "yes": (True,)}[args.documents]
    for t in args.seq:
        for with_docs in docs:
            start = time.perf_counter()
            rows = bench(
                t, tuple(args.ring), with_docs, tuple(args.strategy), args.rounds, args.reps,
                layout=args.layout, trace_calls=args.trace_calls,
            )  # fmt: skip
            for row in rows:
                gpu = ""
                if args.trace_calls:
                    gpu = (
                        f"  GPU {row['gpu_ms']:8.3f} ms  ratio {row['gpu_ratio_to_ideal']:.3f}"
                        f"  a call {row['gpu_call_ms']:8.3f} ms  ratio "
                        f"{row['gpu_call_ratio_to_ideal']:.3f}"
                    )
                print(
                    f"T={t:6d} docs={with_docs!s:5} {'fwd+bwd' if row['bwd'] else 'fwd    '} "
                    f"{row['impl']:10s} n={row['n']} dev={row.get('device', '-')}: "
                    f"{row['ms']:8.3f} ms  ratio to 1/n = {row['ratio_to_ideal']:.3f}{gpu}",
                    flush=True,
                )
            result["rows"].extend(rows)
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
            save()


if __name__ == "__main__":
    main()
