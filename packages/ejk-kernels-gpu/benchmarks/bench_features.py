"""The training features of issue 20 beside cuDNN (``jax.nn``) and tokamax, in one process.

Rows (bf16; TFLOP/s counted on the (query, key) pairs the mask lets through, 4·H FLOPs a
pair and head forward, 3.5x that forward+backward):

- ``documents``: B1 T16384 N16 H128 causal, 8 documents of 2048 tokens, as segment ids,
  as ``cu_seqlens``, and as a padded batch B8 T2048 (ejk); cuDNN with a dense mask;
  tokamax with per-query key ranges (its kernels' ``Mask(k_start=...)``).
- ``window``: B4 T4096 N32 K8 H128 causal, ``sliding_window=(1024, 0)``; cuDNN's and
  tokamax's ``local_window_size``.
- ``softcap``: the same shape causal with ``logits_soft_cap=50`` (ejk, tokamax; cuDNN has
  no soft cap: its row says so), and ejk without it.
- ``head256``: B2 T4096 N16 K8 H256 causal. ``head64``: B8 T2048 N16 H64 causal.

fa4-jax (`_fa4`: FlashAttention-4's kernels from JAX) runs every row it can express (the
documents through ``flash_attn_varlen``; no soft cap); where it is not installed, its rows
say so.

After the rows it prints issue 20's targets as ratios of these times, each with its bound
and whether the run met it (`_targets`; in the JSON as ``targets``).

tokamax's rows (`_tokamax`) try its GPU implementations in the ``--tokamax`` order and
name the one that ran; where tokamax is missing or refuses, the row says so.

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/bench_features.py [--rows documents,window]
        [--rounds 7] [--json out.json --commit SHA] [--tokamax mosaic,triton] [--tokamax-each]
    (--tiny: the same rows on tiny shapes, to check the script on a CPU.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _fa4
import _targets
import _tokamax
import jax
import jax.numpy as jnp
import numpy as np
from _inputs import attention_inputs
from _timing import contender, time_rounds
from _trace import gpu_span_ms

from ejk_kernels_gpu import flash_attention

DEFAULT_GROUPS = (_tokamax.GPU_IMPLEMENTATIONS,)
# The wait before each contender's trace (``--trace-settle``). The rounds hold an H200 at its
# power cap (nvidia-smi's throttle reason 0x4: SM clocks 1740-1920 MHz against 1980 idle,
# cuDNN's dense-mask documents call the heaviest), and it stays there about a second after
# they stop; the first contender traced after them, the documents as segment ids, read its
# kernel 269-291 us in bench_features processes against 256-264 in settled traces
# (benchmarks/results/2026-12-03-h200-documents-power-cap-draft.json).
TRACE_SETTLE_S = 2.0


def _causal_pairs(t: int, left: int | None = None) -> int:
    """Visible (query, key) pairs of one causal sequence of ``t`` tokens (window ``left``)."""
    i = np.arange(t, dtype=np.int64)
    seen = i + 1 if left is None else np.minimum(i + 1, left + 1)
    return int(seen.sum())


def _cudnn(**kw):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)


def _ejk(**kw):
    return lambda q, k, v: flash_attention(q, k, v, **kw)


def _by_ids(name: str):
    """ejk causal with the documents given as ``name`` (a jit argument, as in a training step)."""
    return lambda q, k, v, ids: flash_attention(q, k, v, causal=True, **{name: ids})


def documents(docs=8, length=2048, n=16, h=128, groups=DEFAULT_GROUPS):
    t = docs * length
    q, k, v, d_out = attention_inputs(1, t, n, n, h)
    ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), length)[None]
    cu = jnp.arange(docs + 1, dtype=jnp.int32) * length
    dense = (ids[0][:, None] == ids[0][None, :]) & jnp.tril(jnp.ones((t, t), bool))
    batch = [x.reshape(docs, length, *x.shape[2:]) for x in (q, k, v, d_out)]
    flops = 4 * n * h * docs * _causal_pairs(length)
    shape = dict(B=1, T=t, N=n, K=n, H=h, docs=docs)
    ranges = {**shape, "as": "k_start ranges"}
    padded = {**shape, "as": "padded batch"}
    return flops, [
        ({**shape, "impl": "ejk", "as": "segment_ids"}, _by_ids("segment_ids"), (q, k, v, d_out), (ids,)),
        ({**shape, "impl": "ejk", "as": "cu_seqlens"}, _by_ids("cu_seqlens_q"), (q, k, v, d_out), (cu,)),
        ({**shape, "impl": "ejk", "as": "padded batch"}, _ejk(causal=True), tuple(batch)),
        ({**shape, "impl": "cudnn", "as": "dense mask"}, _cudnn(mask=dense[None, None]), (q, k, v, d_out)),
        ({**shape, "impl": "cudnn", "as": "padded batch"}, _cudnn(is_causal=True), tuple(batch)),
        _fa4.entry({**shape, "as": "cu_seqlens"}, (q, k, v, d_out), (cu,), causal=True),
        *_tokamax.entries(ranges, (q, k, v, d_out), groups, documents=ids, causal=True),
        *_tokamax.entries(padded, tuple(batch), groups, causal=True),
    ]  # fmt: skip


def window(shape=(4, 4096, 32, 8, 128), left=1024, groups=DEFAULT_GROUPS):
    b, t, n, kh, h = shape
    args = attention_inputs(*shape)
    row = dict(B=b, T=t, N=n, K=kh, H=h, window=(left, 0))
    return 4 * b * n * h * _causal_pairs(t, left), [
        ({**row, "impl": "ejk"}, _ejk(causal=True, sliding_window=(left, 0)), args),
        ({**row, "impl": "cudnn"}, _cudnn(is_causal=True, local_window_size=(left, 0)), args),
        _fa4.entry(row, args, causal=True, sliding_window=(left, 0)),
        *_tokamax.entries(row, args, groups, causal=True, sliding_window=(left, 0)),
    ]


def softcap(shape=(4, 4096, 32, 8, 128), cap=50.0, groups=DEFAULT_GROUPS):
    b, t, n, kh, h = shape
    args = attention_inputs(*shape)
    row = dict(B=b, T=t, N=n, K=kh, H=h)
    capped = {**row, "soft_cap": cap}
    no_cap = "not served: jax.nn.dot_product_attention has no logits soft cap"
    return 4 * b * n * h * _causal_pairs(t), [
        ({**capped, "impl": "ejk"}, _ejk(causal=True, logits_soft_cap=cap), args),
        ({**row, "impl": "ejk", "soft_cap": None}, _ejk(causal=True), args),
        ({**capped, "impl": "cudnn", "skipped": no_cap}, None, args),
        _fa4.entry(capped, args, causal=True, logits_soft_cap=cap),
        *_tokamax.entries(capped, args, groups, causal=True, logits_soft_cap=cap),
    ]


def plain_causal(shape, groups=DEFAULT_GROUPS):
    b, t, n, kh, h = shape
    args = attention_inputs(*shape)
    row = dict(B=b, T=t, N=n, K=kh, H=h)
    return 4 * b * n * h * _causal_pairs(t), [
        ({**row, "impl": "ejk"}, _ejk(causal=True), args),
        ({**row, "impl": "cudnn"}, _cudnn(is_causal=True), args),
        _fa4.entry(row, args, causal=True),
        *_tokamax.entries(row, args, groups, causal=True),
    ]


# name: (builder, its arguments at full size, on tiny shapes for a CPU check)
ROWS = {
    "documents": (documents, {}, dict(docs=2, length=16, n=2, h=16)),
    "window": (window, {}, dict(shape=(1, 64, 4, 2, 16), left=16)),
    "softcap": (softcap, {}, dict(shape=(1, 32, 4, 2, 16))),
    "head256": (plain_causal, dict(shape=(2, 4096, 16, 8, 256)), dict(shape=(1, 32, 2, 1, 32))),
    "head64": (plain_causal, dict(shape=(8, 2048, 16, 16, 64)), dict(shape=(1, 32, 2, 2, 16))),
}


def run(
    names: list[str],
    rounds: int,
    with_bwd: bool = True,
    *,
    tiny: bool = False,
    groups: tuple[tuple[str, ...], ...] = DEFAULT_GROUPS,
    trace_calls: int = 0,
    trace_settle: float = 0.0,
) -> list[dict]:
    """Time the rows ``names`` (keys of `ROWS`) in ``rounds`` interleaved rounds, printing
    each as JSON; ``tiny``: their tiny shapes; ``groups``: tokamax's rows, each a tuple of
    its implementations tried in order (none: no tokamax rows). ``trace_calls``: after the
    rounds, trace that many calls of each timed contender back to back: ``*_gpu_ms`` (the GPU
    span a call), ``*_gpu_call_ms`` (a call's own span, without the wait between calls),
    ``*_kernels_ms`` (its kernels by name; `_trace.gpu_span_ms`), NaN where the trace
    holds no GPU kernel (a CPU run). ``trace_settle``: seconds to wait before each
    contender's trace, so that none is traced while the GPU is still held under its power
    cap by the rounds before it (`TRACE_SETTLE_S`)."""
    rows = []
    for name in names:
        build, full, small = ROWS[name]
        flops, entries = build(**(small if tiny else full), groups=groups)
        cases = [
            contender({"row": name, **row}, fn, args, with_bwd, *side)
            for row, fn, args, *side in entries
        ]
        timed_rows = time_rounds(cases, rounds, flops)
        if trace_calls:
            for row, timed, _ in cases:
                for key, f, a, _ in timed:
                    time.sleep(trace_settle)
                    span, _, kernels, call = gpu_span_ms(f, a, trace_calls)
                    row[f"{key}_gpu_ms"] = span
                    row[f"{key}_gpu_call_ms"] = call
                    row[f"{key}_kernels_ms"] = kernels
        for row in timed_rows:
            print(json.dumps(row, default=str), flush=True)
            rows.append(row)
    return rows


def _table(rows: list[dict]) -> None:
    print(
        f"\n{'row':<10}{'impl':<16}{'as':<16}{'fwd TF/s':>9}{'f+b TF/s':>9}{'fwd ms':>9}"
        f"{'f+b ms':>9}"
    )
    for r in rows:
        impl = f"{r['impl']}/{r['ran']}" if "ran" in r else r["impl"]
        label = r.get("as", r.get("soft_cap", ""))
        head = f"{r['row']:<10}{impl:<16}{label!s:<16}"
        if "error" in r or "skipped" in r:
            print(
                f"{head}{'error' if 'error' in r else 'skipped'}: {r.get('error', r.get('skipped'))[:90]}"
            )
            continue
        print(
            f"{head}{r['fwd_tflops']:>9.1f}{r.get('fwdbwd_tflops', float('nan')):>9.1f}"
            f"{r['fwd_ms']:>9.3f}{r.get('fwdbwd_ms', float('nan')):>9.3f}"
            + (f"  f+b error: {r['fwdbwd_error'][:60]}" if "fwdbwd_error" in r else "")
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {list(ROWS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-bwd", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--commit", default="")
    _tokamax.add_arguments(parser)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument(
        "--trace-calls", type=int, default=0,
        help="also trace this many calls of each contender for its GPU span (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--trace-settle", type=float, default=TRACE_SETTLE_S,
        help=f"seconds to wait before each contender's trace (default {TRACE_SETTLE_S})",
    )  # fmt: skip
    args = parser.parse_args()
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    print("#", jax.devices(), jax.__version__)
    groups = _tokamax.groups_of(args)
    rows = run(
        names, args.rounds, with_bwd=not args.no_bwd, tiny=args.tiny, groups=groups,
        trace_calls=args.trace_calls, trace_settle=args.trace_settle,
    )  # fmt: skip
    _table(rows)
    targets = _targets.evaluate(rows)
    print(_targets.table(targets))
    if args.json:
        from gpu_conformance import run_info

        with open(args.json, "w") as f:
            json.dump(
                {**run_info("bench_features.py", args.commit), "rows": rows, "targets": targets},
                f,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
