"""PyTorch FlexAttention on `bench_flex.py`'s rows: the contender of issue 62's ≥ 1.3x target.

Runs in its own process (PyTorch; torch 2.11 is in the GPU image), in the same device call
as `bench_flex.py` (JAX), on the same shapes and mods, bf16:

- ``documents``: B1 T16384 N16 H128, 16 causal documents (``mask_mod``: causal and equal
  document ids);
- ``window``: B4 T4096 N32 K8 H128, causal within 1024 keys (GQA: ``enable_gqa``);
- ``alibi`` / ``relative``: the same GQA shape, causal, ALiBi over per-head slopes and a
  learnable relative-position table (span 128) as score_mods; ``none``: causal alone.

Each row is ``torch.compile(flex_attention, dynamic=False)`` with a ``create_block_mask``
of 128-token blocks built once (as a model reuses it in every layer). Dynamo's recompile
limits are raised first: past them it silently runs an unfused path (../shared/gpu/README.md).
Forward+backward takes gradients of q, k, v (and the table) with ``torch.autograd.grad``.
TFLOP/s counts the (query, key) pairs the mask lets through, 4·H FLOPs a pair and head,
3.5x for forward+backward, as `bench_flex.py` does.

``--check`` compares each row's output, batch 0 and heads 0-1, with a dense float32
computation of the same mods (relative L2 error, in the JSON as ``rel_err``).

Timing: CUDA events around ``reps`` calls, rounds interleaved between the rows of one
shape; the median round gives ms per call.

``--ejk-json F`` (the JSON `bench_flex.py` wrote in the same device call) adds issue 62's
ratios to the output: PyTorch's time over ejk's for each row's flex call.

Usage (GPU machine):
    python3 packages/ejk-attention/benchmarks/bench_flex_torch.py [--check]
        [--rows documents,window,alibi,relative] [--json out.json --commit SHA]
        [--ejk-json bench_flex.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

# The PyTorch timing shared with the kernel package's FA4 benchmark.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ejk-kernels-gpu" / "benchmarks"))
from _flex_pairs import visible_pairs
from _torch_timing import time_interleaved

BLOCK = 128
REPS = 10
# (row, PyTorch label, bench_flex row label, timing, bound): the ratios --ejk-json reports.
TARGETS = [
    (row, "flex", ejk_label, key, 1.3)
    for row, ejk_label in [
        ("documents", "flex"),
        ("window", "flex"),
        ("alibi", "score_mod"),
        ("relative", "score_mod"),
    ]
    for key in ("fwd", "fwdbwd")
]


def _inputs(b: int, t: int, n: int, k: int, h: int, seed: int):
    """q, k, v in ``[B, N, T, H]`` (PyTorch's layout) and the cotangent, bf16, drawn in f32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(b, n, t, h), (b, k, t, h), (b, k, t, h), (b, n, t, h)]
    return [
        torch.randn(s, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16)
        for s in shapes
    ]


def rows_of(name: str) -> tuple[dict, int, list]:
    """``(shape, visible pairs, [(label, mask_mod, score_mod, score captures)])`` of row
    ``name``; mods are written with tensor ops, so they also run densely (`_dense`)."""

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if name == "documents":
        t, docs = 16384, 16
        ids = torch.arange(docs, device="cuda", dtype=torch.int32).repeat_interleave(t // docs)

        def doc_mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (ids[q_idx] == ids[kv_idx])

        return (
            dict(B=1, T=t, N=16, K=16, H=128, docs=docs),
            visible_pairs(ids.cpu().numpy()),
            [("flex", doc_mask, None, [])],
        )
    shape = dict(B=4, T=4096, N=32, K=8, H=128)
    t, n = shape["T"], shape["N"]
    zeros = np.zeros(t, np.int32)
    if name == "window":
        left = 1024

        def window_mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

        return (
            {**shape, "window": (left, 0)},
            visible_pairs(zeros, left),
            [("flex", window_mask, None, [])],
        )
    if name == "alibi":
        slopes = 2.0 ** (-8.0 * torch.arange(1, n + 1, device="cuda", dtype=torch.float32) / n)

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx).abs()

        return (
            shape,
            visible_pairs(zeros),
            [("flex", causal, alibi, []), ("none", causal, None, [])],
        )
    if name == "relative":
        span = 128
        gen = torch.Generator(device="cuda").manual_seed(1)
        table = 0.02 * torch.randn((n, 2 * span + 1), generator=gen, device="cuda")
        table.requires_grad_(True)

        def relative(score, b, h, q_idx, kv_idx):
            return score + table[h, (kv_idx - q_idx).clamp(-span, span) + span]

        return (
            shape,
            visible_pairs(zeros),
            [
                ("flex", causal, relative, [table]),
                ("none", causal, None, []),
            ],
        )
    raise ValueError(f"--rows: unknown row {name!r}; choose from {ROWS}")


ROWS = ["documents", "window", "alibi", "relative"]


def _dense(q, k, v, mask_mod, score_mod, batch: int = 0, heads: int = 2) -> torch.Tensor:
    """The row's output for ``batch`` and the first ``heads`` heads, densely in float32."""
    group = q.shape[1] // k.shape[1]
    t, s = q.shape[2], k.shape[2]
    qi = torch.arange(t, device="cuda")[:, None]
    ki = torch.arange(s, device="cuda")[None, :]
    outs = []
    for h in range(heads):
        hq = torch.tensor(h, device="cuda")
        scores = q[batch, h].float() @ k[batch, h // group].float().T / q.shape[-1] ** 0.5
        if score_mod is not None:
            scores = score_mod(scores, batch, hq, qi, ki)
        scores = scores.masked_fill(~mask_mod(batch, hq, qi, ki), float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ v[batch, h // group].float())
    return torch.stack(outs)


def bench_row(name: str, rounds: int, check: bool, compiled) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask

    shape, pairs, entries = rows_of(name)
    b, t, n, kh, h = (shape[x] for x in "BTNKH")
    q, k, v, d_out = _inputs(b, t, n, kh, h, seed=sum((b, t, n, kh, h)))
    flops = 4 * b * n * h * pairs
    fns, rows = {}, []
    for label, mask_mod, score_mod, captures in entries:
        row = dict(row=name, impl="torch-flex", **{"as": label}, **shape)
        try:
            block_mask = create_block_mask(mask_mod, None, None, t, t, device="cuda",
                                           BLOCK_SIZE=BLOCK)  # fmt: skip

            def fwd(mask=block_mask, score=score_mod):
                return compiled(q, k, v, score_mod=score, block_mask=mask, enable_gqa=kh != n)

            wrt = [x.detach().requires_grad_(True) for x in (q, k, v)]

            def fwdbwd(mask=block_mask, score=score_mod, wrt=wrt, captures=captures):
                out = compiled(*wrt, score_mod=score, block_mask=mask, enable_gqa=kh != n)
                return torch.autograd.grad(out, [*wrt, *captures], d_out)

            if check:
                with torch.no_grad():
                    got = fwd()[0, :2].float()
                    want = _dense(q, k, v, mask_mod, score_mod)
                row["rel_err"] = float((got - want).norm() / want.norm())
            fns[(label, "fwd")], fns[(label, "fwdbwd")] = fwd, fwdbwd
            row["sparsity"] = float(block_mask.sparsity())
        except Exception as exc:  # report the row, go on with the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        rows.append(row)
    timed = time_interleaved(fns, rounds, REPS)
    for row in rows:
        for key in ("fwd", "fwdbwd"):
            if (row["as"], key) in timed:
                med, best = timed[(row["as"], key)]
                factor = 3.5 if key == "fwdbwd" else 1.0
                row |= {f"{key}_ms": med, f"{key}_best_ms": best,
                        f"{key}_tflops": factor * flops / (med * 1e-3) / 1e12}  # fmt: skip
        print(json.dumps(row), flush=True)
    return rows


def ratios(rows: list[dict], ejk_rows: list[dict]) -> list[dict]:
    """Issue 62's ratios: PyTorch FlexAttention's time over ejk's flex call, per row."""

    def ms(found, row, label, key):
        for r in found:
            if r.get("row") == row and r.get("as") == label and f"{key}_ms" in r:
                return r[f"{key}_ms"]
        return None

    out = []
    for row, label, ejk_label, key, bound in TARGETS:
        torch_ms, ejk_ms = ms(rows, row, label, key), ms(ejk_rows, row, ejk_label, key)
        target = dict(target=f"{row} flex vs PyTorch FlexAttention", timing=key, bound=bound)
        if torch_ms is None or ejk_ms is None:
            out.append({**target, "met": None, "why": "not timed"})
            continue
        ratio = torch_ms / ejk_ms
        out.append({**target, "ratio": ratio, "met": ratio >= bound})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--commit", default="")
    parser.add_argument("--ejk-json", default="", help="bench_flex.py's JSON, for the ratios")
    args = parser.parse_args(argv)
    from torch.nn.attention.flex_attention import flex_attention

    # Past dynamo's default limits, further shapes run unfused (3-18 TFLOP/s).
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.cache_size_limit = 64
    compiled = torch.compile(flex_attention, dynamic=False)
    rows = []
    for name in [r for r in args.rows.split(",") if r]:
        try:
            rows += bench_row(name, args.rounds, args.check, compiled)
        except Exception as exc:
            rows.append(dict(row=name, error=f"{type(exc).__name__}: {str(exc)[:400]}"))
            print(json.dumps(rows[-1]), flush=True)
    targets = []
    if args.ejk_json:
        with open(args.ejk_json) as f:
            targets = ratios(rows, json.load(f)["rows"])
        for t in targets:
            print(json.dumps(t), flush=True)
    if args.json:
        info = dict(
            script="packages/ejk-attention/benchmarks/bench_flex_torch.py", argv=sys.argv[1:],
            commit=args.commit, device=torch.cuda.get_device_name(),
            versions=dict(torch=torch.__version__),
        )  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({**info, "rows": rows, "targets": targets}, f, indent=1)
    failed = [r for r in rows if "error" in r or r.get("rel_err", 0.0) > 2e-2]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
