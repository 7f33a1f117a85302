"""Forward and forward+backward TFLOP/s of ejk's Triton flash attention against JAX baselines.

In one process, on the same bf16 inputs: ejk_kernels_gpu.flash_attention,
``jax.nn.dot_product_attention`` (implementation 'cudnn' and 'xla'), JAX's
Pallas GPU attention (``jax.experimental.pallas.ops.gpu.attention.mha``) where it
imports and supports the shape, and ``tokamax.dot_product_attention`` (its GPU
implementations tried in the ``--tokamax`` order, the row naming the one that ran; a row
saying so where tokamax is missing or refuses, see `_tokamax`).
FLOPs: 4·B·N·T·S·H, halved when causal; the backward counts 2.5x the forward, so
forward+backward is 3.5x.

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-kernels-gpu/benchmarks/bench_flash.py [--only ejk] [--sweep]
        [--tokamax mosaic,triton] [--tokamax-each]

Every variant of a shape is compiled first, then timed in interleaved rounds (see
`bench_shape`); the table's spread column is how far its rounds differed.
"""

from __future__ import annotations

import argparse
import json
import sys

import _fa4
import _tokamax
import jax
from _inputs import attention_inputs
from _timing import contender, time_rounds

from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, flash_attention

SHAPES = [  # (B, T, N, K, H, causal)
    (4, 4096, 32, 32, 128, False),
    (4, 4096, 32, 32, 128, True),
    (4, 4096, 32, 8, 128, True),
    (1, 16384, 16, 16, 128, True),
    (8, 2048, 16, 16, 64, True),
]


def _impls(causal, heads, kv_heads, fwd_cfg=None, bwd_cfg=None):
    impls = {
        "ejk": lambda q, k, v: flash_attention(
            q, k, v, causal=causal, config=fwd_cfg, bwd_config=bwd_cfg
        ),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"
        ),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"
        ),
    }
    fa4, why = _fa4.call(causal=causal)
    if fa4 is not None:
        impls["fa4"] = fa4
    else:
        print(f"# {why}")
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        if heads == kv_heads:
            impls["pallas"] = lambda q, k, v: pallas_attention.mha(
                q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal
            )
    except Exception as exc:  # pallas GPU attention is optional
        print(f"# pallas attention unavailable: {type(exc).__name__}: {exc}")
    return impls


def bench_shape(
    shape, variants, with_bwd=True, rounds=7, tokamax_groups=(_tokamax.GPU_IMPLEMENTATIONS,)
):
    """Rows for ``variants`` = [(impl, fwd_cfg, bwd_cfg, label)] on one shape; the impl
    ``"tokamax"`` gives a row for each of ``tokamax_groups`` (`_tokamax.entries`).

    Every variant is compiled and warmed first; then each round times every variant in
    turn (interleaved), so a drift of the card's clocks over the run falls on all of them
    alike. A row reports the median over rounds, the best round and the spread
    (max/min - 1) of its rounds.
    """
    B, T, N, K, H, causal = shape
    args = attention_inputs(B, T, N, K, H)
    flops = 4 * B * N * T * T * H / (2 if causal else 1)
    cases = []
    for name, fwd_cfg, bwd_cfg, label in variants:
        row = dict(impl=name, B=B, T=T, N=N, K=K, H=H, causal=causal)
        if name == "tokamax":
            for entry in _tokamax.entries(row, args, tokamax_groups, causal=causal):
                cases.append(contender(*entry[:3], with_bwd))
            continue
        fn = _impls(causal, N, K, fwd_cfg, bwd_cfg).get(name)
        if fn is None:  # JAX's Pallas attention: not importable here, or GQA
            continue
        if label:
            row["cfg"] = label
        cases.append(contender(row, fn, args, with_bwd))
    rows = time_rounds(cases, rounds, flops)
    for row in rows:
        print(json.dumps(row, default=str), flush=True)
    return rows


def _table(rows):
    print(
        f"{'shape':<34}{'impl':<16}{'fwd TF/s':>10}{'f+b TF/s':>10}{'fwd ms':>9}{'f+b ms':>9}"
        f"{'spread':>8}"
    )
    for r in rows:
        shape = f"({r['B']},{r['T']},{r['N']},{r['K']},{r['H']}){' causal' if r['causal'] else ''}"
        impl = f"{r['impl']}/{r['ran']}" if "ran" in r else r["impl"]
        if "error" in r or "skipped" in r:
            why = "error" if "error" in r else "skipped"
            print(f"{shape:<34}{impl:<16}  {why}: {r[why][:80]}")
            continue
        fb = r.get("fwdbwd_tflops", float("nan"))
        fbm = r.get("fwdbwd_ms", float("nan"))
        spread = max(r["fwd_spread"], r.get("fwdbwd_spread", 0.0))
        print(
            f"{shape:<34}{impl:<16}{r['fwd_tflops']:>10.1f}{fb:>10.1f}{r['fwd_ms']:>9.3f}"
            f"{fbm:>9.3f}{spread:>7.1%}  {r.get('cfg', '')}"
            + (f"  f+b error: {r['fwdbwd_error'][:60]}" if "fwdbwd_error" in r else "")
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--only", default="", help="comma-separated impls (ejk,fa4,cudnn,xla,pallas,tokamax)"
    )
    parser.add_argument("--shapes", default="", help="comma-separated indices into SHAPES")
    parser.add_argument("--sweep", action="store_true", help="time ejk configs on the shapes")
    parser.add_argument("--no-bwd", action="store_true")
    parser.add_argument("--json", default="", help="write every row, device and versions here")
    parser.add_argument("--commit", default="", help="the commit under test (for the JSON)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    parser.add_argument(
        "--fwd-cfg",
        default="",
        help="ejk forward config bq,bk,warps,stages[,warp_specialize]; several separated by ';' "
        "(an empty one: the heuristic)",
    )
    parser.add_argument(
        "--bwd-cfg",
        default="",
        help="ejk backward config keys,queries,warps,stages[,flag...] (block_keys resident in "
        "dk/dv, block_queries a step); several separated by ';' "
        "(an empty one: the heuristic)",
    )
    _tokamax.add_arguments(parser)
    args = parser.parse_args()

    def cfg(text, backward=False):
        if not text:
            return None
        rows, step, w, st, *flags = text.split(",")
        tiles = ("block_keys", "block_queries") if backward else ("block_q", "block_k")
        kind = FlashBackwardConfig if backward else FlashConfig
        return kind(**dict(zip(tiles, (int(rows), int(step)), strict=True)), num_warps=int(w),
                    num_stages=int(st), **{f: True for f in flags})  # fmt: skip

    print("#", jax.devices(), jax.__version__)
    only = set(filter(None, args.only.split(",")))
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    rows = []
    if args.sweep:
        fwd_cands = [
            FlashConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=s)
            for bq, bk, w, s in [
                (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
                (64, 64, 4, 3), (64, 128, 4, 3),
            ]
        ]  # fmt: skip
        bwd_cands = [  # keys resident in dk/dv (query rows in the dq kernel), rows streamed
            FlashBackwardConfig(block_keys=bk, block_queries=bq, num_warps=w, num_stages=s)
            for bk, bq, w, s in [
                (64, 64, 4, 2), (128, 32, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (128, 32, 4, 3),
                (64, 32, 4, 3), (128, 64, 8, 3),
            ]
        ]  # fmt: skip
        for shape in shapes:
            fwd = [("ejk", c, None, str(c)) for c in fwd_cands]
            rows += bench_shape(shape, fwd, with_bwd=False)
            rows += bench_shape(shape, [("ejk", None, c, "bwd " + str(c)) for c in bwd_cands])
        _table(rows)
        return 0
    fwd_cfgs = [cfg(text) for text in args.fwd_cfg.split(";")]
    bwd_cfgs = [cfg(text, backward=True) for text in args.bwd_cfg.split(";")]
    names = [
        n for n in ("ejk", "fa4", "cudnn", "xla", "pallas", "tokamax") if not only or n in only
    ]
    groups = _tokamax.groups_of(args)
    for shape in shapes:
        variants = [(n, fwd_cfgs[0], bwd_cfgs[0], None) for n in names]
        # Further configs (ejk only): each forward one with the first backward one, and
        # each further backward one with the first forward one.
        variants += [("ejk", c, bwd_cfgs[0], str(c or "heuristic")) for c in fwd_cfgs[1:]]
        variants += [("ejk", fwd_cfgs[0], c, f"bwd {c or 'heuristic'}") for c in bwd_cfgs[1:]]
        rows += bench_shape(
            shape, variants, with_bwd=not args.no_bwd, rounds=args.rounds, tokamax_groups=groups
        )
    _table(rows)
    if args.json:
        from gpu_conformance import run_info

        result = {**run_info("bench_flash.py", args.commit), "rows": rows}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
