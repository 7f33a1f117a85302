"""The training features of issue 20 beside cuDNN (``jax.nn``), in one process.

Rows (bf16; TFLOP/s counted on the (query, key) pairs the mask lets through, 4·H FLOPs a
pair and head forward, 3.5x that forward+backward):

- ``documents``: B1 T16384 N16 H128 causal, 8 documents of 2048 tokens, as segment ids,
  as ``cu_seqlens``, and as a padded batch B8 T2048 (ejk); cuDNN with a dense mask.
- ``window``: B4 T4096 N32 K8 H128 causal, ``sliding_window=(1024, 0)``; cuDNN's
  ``local_window_size``.
- ``softcap``: the same shape causal with ``logits_soft_cap=50``, and ejk without it.
- ``head256``: B2 T4096 N16 K8 H256 causal. ``head64``: B8 T2048 N16 H64 causal.

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/bench_features.py [--rows documents,window]
        [--rounds 7] [--json out.json --commit SHA]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from _timing import contender, time_rounds

from ejk_kernels_gpu import flash_attention


def _inputs(b, t, n, k, h, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, k, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, k, h), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
    return q, kk, v, d_out


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


def documents(docs: int = 8, length: int = 2048, n: int = 16, h: int = 128):
    t = docs * length
    q, k, v, d_out = _inputs(1, t, n, n, h)
    ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), length)[None]
    cu = jnp.arange(docs + 1, dtype=jnp.int32) * length
    dense = (ids[0][:, None] == ids[0][None, :]) & jnp.tril(jnp.ones((t, t), bool))
    batch = [x.reshape(docs, length, *x.shape[2:]) for x in (q, k, v, d_out)]
    flops = 4 * n * h * docs * _causal_pairs(length)
    shape = dict(B=1, T=t, N=n, K=n, H=h, docs=docs)
    return flops, [
        ({**shape, "impl": "ejk", "as": "segment_ids"}, _by_ids("segment_ids"), (q, k, v, d_out), (ids,)),
        ({**shape, "impl": "ejk", "as": "cu_seqlens"}, _by_ids("cu_seqlens_q"), (q, k, v, d_out), (cu,)),
        ({**shape, "impl": "ejk", "as": "padded batch"}, _ejk(causal=True), tuple(batch)),
        ({**shape, "impl": "cudnn", "as": "dense mask"}, _cudnn(mask=dense[None, None]), (q, k, v, d_out)),
        ({**shape, "impl": "cudnn", "as": "padded batch"}, _cudnn(is_causal=True), tuple(batch)),
    ]  # fmt: skip


def window(left: int = 1024):
    b, t, n, kh, h = 4, 4096, 32, 8, 128
    args = _inputs(b, t, n, kh, h)
    shape = dict(B=b, T=t, N=n, K=kh, H=h, window=(left, 0))
    return 4 * b * n * h * _causal_pairs(t, left), [
        ({**shape, "impl": "ejk"}, _ejk(causal=True, sliding_window=(left, 0)), args),
        ({**shape, "impl": "cudnn"}, _cudnn(is_causal=True, local_window_size=(left, 0)), args),
    ]


def softcap(cap: float = 50.0):
    b, t, n, kh, h = 4, 4096, 32, 8, 128
    args = _inputs(b, t, n, kh, h)
    shape = dict(B=b, T=t, N=n, K=kh, H=h)
    return 4 * b * n * h * _causal_pairs(t), [
        ({**shape, "impl": "ejk", "soft_cap": cap}, _ejk(causal=True, logits_soft_cap=cap), args),
        ({**shape, "impl": "ejk", "soft_cap": None}, _ejk(causal=True), args),
    ]


def _plain_causal(b, t, n, kh, h):
    args = _inputs(b, t, n, kh, h)
    shape = dict(B=b, T=t, N=n, K=kh, H=h)
    return 4 * b * n * h * _causal_pairs(t), [
        ({**shape, "impl": "ejk"}, _ejk(causal=True), args),
        ({**shape, "impl": "cudnn"}, _cudnn(is_causal=True), args),
    ]


ROWS = {
    "documents": documents,
    "window": window,
    "softcap": softcap,
    "head256": lambda: _plain_causal(2, 4096, 16, 8, 256),
    "head64": lambda: _plain_causal(8, 2048, 16, 16, 64),
}


def run(names: list[str], rounds: int, with_bwd: bool = True) -> list[dict]:
    rows = []
    for name in names:
        flops, entries = ROWS[name]()
        cases = [
            contender({"row": name, **row}, fn, args, with_bwd, *side)
            for row, fn, args, *side in entries
        ]
        for row in time_rounds(cases, rounds, flops):
            print(json.dumps(row, default=str), flush=True)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {list(ROWS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-bwd", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    print("#", jax.devices(), jax.__version__)
    rows = run(names, args.rounds, with_bwd=not args.no_bwd)
    print(
        f"\n{'row':<10}{'impl':<7}{'as':<14}{'fwd TF/s':>9}{'f+b TF/s':>9}{'fwd ms':>9}{'f+b ms':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['row']:<10}{r['impl']:<7}{r.get('as', ''):<14} error: {r['error'][:70]}")
            continue
        label = r.get("as", r.get("soft_cap", ""))
        print(
            f"{r['row']:<10}{r['impl']:<7}{label!s:<14}{r['fwd_tflops']:>9.1f}"
            f"{r.get('fwdbwd_tflops', float('nan')):>9.1f}{r['fwd_ms']:>9.3f}"
            f"{r.get('fwdbwd_ms', float('nan')):>9.3f}"
        )
    if args.json:
        from gpu_conformance import run_info

        with open(args.json, "w") as f:
            json.dump(
                {**run_info("bench_features.py", args.commit), "rows": rows},
                f,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
