"""Flex attention's Triton backend against ejk's built-in masks, in one process (issue 62).

Rows (bf16, ``implementation="triton"`` throughout; TFLOP/s on the (query, key) pairs the
mask lets through, 4·H FLOPs a pair and head forward, 3.5x that forward+backward):

- ``documents``: B1 T16384 N16 H128, 16 causal documents: ``flex_attention`` with
  ``and_masks(causal_mask, document_mask(ids))`` (``flex``: ejk's mods, which the backend
  runs on its built-in kernels; ``flex kernels``: the same mask as a user's own function,
  on the flex kernels) against ``flash_attention(causal=True, segment_ids=ids)`` and
  fa4-jax's ``document_mask`` mask_mod (where fa4-jax imports; ../shared/gpu/README.md);
- ``window``: B4 T4096 N32 K8 H128, ``sliding_window_mask((1024, 0))`` and causal as a
  mask_mod (both ways, as above) against ``flash_attention(causal=True,
  sliding_window=(1024, 0))``;
- ``alibi`` / ``relative``: B4 T4096 N32 K8 H128 causal, ALiBi over captured slopes and a
  learnable relative-position table as score_mods, against the same flex call without one;
- ``mask128k``: ``create_block_mask`` of 64 causal documents at T = 131072 under
  ``jax.jit``, against one forward+backward of the flex call it serves (B1 N16 H128).

The block masks are jit arguments (built once, outside the timed calls), as a model reuses
one mask in every layer. After the rows it prints issue 62's targets as ratios of these
times, each with its bound and whether the run met it (in the JSON as ``targets``).

``--check`` first compares each row's flex call with its reference on the row's inputs
(outputs and q, k, v gradients by relative L2 error, within `BF16_TOL`, no NaN): the
built-in masks for ``documents``/``window``, the ``xla`` flex backend on float32-upcast
inputs for the score_mods (their table's gradient too): the compiled kernels' numerics,
which the CPU tests see only through Triton's interpreter (in the JSON as ``checks``).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-attention/benchmarks/bench_flex.py [--rows documents,window]
        [--rounds 7] [--json out.json --commit SHA]
        [--check]
    (--tiny: the same rows on tiny shapes, to check the script on a CPU in Triton's
    interpreter.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_KERNEL_BENCHMARKS = Path(__file__).resolve().parents[2] / "ejk-kernels-gpu" / "benchmarks"
sys.path.insert(0, str(_KERNEL_BENCHMARKS))

import _fa4  # noqa: E402
from _flex_pairs import visible_pairs  # noqa: E402
from _inputs import attention_inputs  # noqa: E402
from _timing import contender, time_rounds  # noqa: E402

from ejk_attention import (  # noqa: E402
    and_masks,
    causal_mask,
    create_block_mask,
    document_mask,
    flash_attention,
    flex_attention,
    sliding_window_mask,
)

BF16_TOL = 2e-2  # as gpu_conformance.py: bf16 operands against a float32 reference
# (name, contender, reference, timing, bound): issue 62's targets, each row named by (row,
# label); met where the reference's time over the contender's is at least the bound.
_DOCS = (("documents", "flex"), ("documents", "segment_ids"))
_DOCS_FA4 = (("documents", "flex"), ("documents", "fa4-jax mask_mod"))
_WINDOW = (("window", "flex"), ("window", "sliding_window"))
# The same masks written as a user's own functions: the flex kernels (ejk's mods run on the
# built-in kernels, `ejk_attention.flex._builtin`).
_DOCS_OWN = (("documents", "flex kernels"), ("documents", "segment_ids"))
_WINDOW_OWN = (("window", "flex kernels"), ("window", "sliding_window"))
TARGETS = [
    ("documents as a mask_mod vs segment ids", *_DOCS, "fwd", 0.9),
    ("documents as a mask_mod vs segment ids", *_DOCS, "fwdbwd", 0.9),
    ("documents as a user's mask_mod vs segment ids", *_DOCS_OWN, "fwd", 0.9),
    ("documents as a user's mask_mod vs segment ids", *_DOCS_OWN, "fwdbwd", 0.9),
    ("documents as a mask_mod vs fa4-jax's mask_mod", *_DOCS_FA4, "fwd", 1.0),
    ("documents as a mask_mod vs fa4-jax's mask_mod", *_DOCS_FA4, "fwdbwd", 1.0),
    ("window as a mask_mod vs the built-in", *_WINDOW, "fwd", 0.9),
    ("window as a mask_mod vs the built-in", *_WINDOW, "fwdbwd", 0.9),
    ("window as a user's mask_mod vs the built-in", *_WINDOW_OWN, "fwd", 0.9),
    ("window as a user's mask_mod vs the built-in", *_WINDOW_OWN, "fwdbwd", 0.9),
    ("ALiBi score_mod vs none", ("alibi", "score_mod"), ("alibi", "none"), "fwdbwd", 0.85),
    (
        "relative table score_mod vs none",
        ("relative", "score_mod"),
        ("relative", "none"),
        "fwdbwd",
        0.85,
    ),
]


def _flex(score=None):
    """``flex_attention`` on the Triton kernels; ``score(side) -> score_mod`` or None."""

    def call(q, k, v, mask, *side):
        score_mod = None if score is None else score(*side)
        return flex_attention(q, k, v, score_mod, mask, implementation="triton")

    return call


def _own(mask_mod):
    """``mask_mod`` as a user's own function (a closure, not one of ejk's mods): the flex
    kernels run it, where ejk's mods alone run on the built-in kernels."""
    return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx)


def _alibi(slopes):
    return lambda s, b, h, q_idx, kv_idx: s - slopes[h] * jnp.abs(q_idx - kv_idx).astype(s.dtype)


def _relative(table):
    span = (table.shape[1] - 1) // 2
    return lambda s, b, h, q_idx, kv_idx: s + table[h, jnp.clip(kv_idx - q_idx, -span, span) + span]


def documents(docs=16, t=16384, n=16, h=128, block=128):
    q, k, v, d_out = attention_inputs(1, t, n, n, h)
    ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), t // docs)[None]
    mask = create_block_mask(and_masks(causal_mask, document_mask(ids)), 1, None, t, t,
                             block_size=block)  # fmt: skip
    row = dict(B=1, T=t, N=n, K=n, H=h, docs=docs)
    builtin = lambda q, k, v, ids: flash_attention(
        q, k, v, causal=True, segment_ids=ids, implementation="triton"
    )
    flops = 4 * n * h * visible_pairs(np.asarray(ids[0]))
    own = create_block_mask(_own(and_masks(causal_mask, document_mask(ids))), 1, None, t, t,
                            block_size=block)  # fmt: skip
    return flops, [
        ({**row, "as": "flex"}, _flex(), (q, k, v, d_out), (mask,)),
        ({**row, "as": "flex kernels"}, _flex(), (q, k, v, d_out), (own,)),
        ({**row, "as": "segment_ids"}, builtin, (q, k, v, d_out), (ids,)),
        _fa4_documents({**row, "as": "fa4-jax mask_mod"}, (q, k, v, d_out), ids),
    ]


def _fa4_documents(row: dict, args: tuple, ids) -> tuple:
    """fa4-jax on the documents row: causal and its own ``document_mask(ids)`` mask_mod,
    evaluated on every visited tile (it skips no block the mask empties)."""
    fa4, why = _fa4.load()
    row = {**row, "impl": "fa4-jax"}
    if fa4 is None:
        return {**row, "skipped": why}, None, args
    fn = lambda q, k, v, ids: fa4.flash_attn(q, k, v, causal=True, mask_mod=fa4.document_mask(ids))
    return row, fn, args, (ids,)


def window(shape=(4, 4096, 32, 8, 128), left=1024, block=128):
    b, t, n, kh, h = shape
    args = attention_inputs(*shape)
    causal_window = and_masks(causal_mask, sliding_window_mask((left, 0)))
    mask = create_block_mask(causal_window, None, None, t, t, block_size=block)
    own = create_block_mask(_own(causal_window), None, None, t, t, block_size=block)
    row = dict(B=b, T=t, N=n, K=kh, H=h, window=(left, 0))
    builtin = lambda q, k, v: flash_attention(
        q, k, v, causal=True, sliding_window=(left, 0), implementation="triton"
    )
    flops = 4 * b * n * h * visible_pairs(np.zeros(t, np.int32), left)
    return flops, [
        ({**row, "as": "flex"}, _flex(), args, (mask,)),
        ({**row, "as": "flex kernels"}, _flex(), args, (own,)),
        ({**row, "as": "sliding_window"}, builtin, args),
    ]


def _scored(make, side, shape, block):
    b, t, n, kh, h = shape
    args = attention_inputs(*shape)
    mask = create_block_mask(causal_mask, None, None, t, t, block_size=block)
    row = dict(B=b, T=t, N=n, K=kh, H=h)
    return 4 * b * n * h * visible_pairs(np.zeros(t, np.int32)), [
        ({**row, "as": "score_mod"}, _flex(make), args, (mask, side)),
        ({**row, "as": "none"}, _flex(), args, (mask,)),
    ]


def alibi(shape=(4, 4096, 32, 8, 128), block=128):
    slopes = 2.0 ** (-8.0 * jnp.arange(1, shape[2] + 1, dtype=jnp.float32) / shape[2])
    return _scored(_alibi, slopes, shape, block)


def relative(shape=(4, 4096, 32, 8, 128), span=128, block=128):
    table = 0.02 * jax.random.normal(jax.random.key(1), (shape[2], 2 * span + 1), jnp.float32)
    return _scored(_relative, table, shape, block)


def mask128k(docs=64, t=131072, n=16, h=128, block=128):
    """``create_block_mask`` under jit (forward-only row) and the call it serves."""
    q, k, v, d_out = attention_inputs(1, t, n, n, h)
    ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), t // docs)[None]

    def build(ids):
        return create_block_mask(and_masks(causal_mask, document_mask(ids)), 1, None, t, t,
                                 block_size=block)  # fmt: skip

    row = dict(B=1, T=t, N=n, K=n, H=h, docs=docs)
    flops = 4 * n * h * visible_pairs(np.asarray(ids[0]))
    return flops, [
        ({**row, "as": "flex"}, _flex(), (q, k, v, d_out), (build(ids),)),
        ({**row, "as": "create_block_mask", "build_only": True}, build, (ids, None)),
    ]


# name: (builder, its arguments on tiny shapes for a CPU check)
ROWS = {
    "documents": (documents, dict(docs=2, t=64, n=2, h=16, block=16)),
    "window": (window, dict(shape=(1, 64, 4, 2, 16), left=16, block=16)),
    "alibi": (alibi, dict(shape=(1, 48, 4, 2, 16), block=16)),
    "relative": (relative, dict(shape=(1, 48, 4, 2, 16), span=8, block=16)),
    "mask128k": (mask128k, dict(docs=2, t=64, n=2, h=16, block=16)),
}


def _relative_error(got, want) -> float:
    got, want = (np.asarray(x, np.float64) for x in (got, want))
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(name: str, tiny: bool) -> list[dict]:
    """Row ``name``'s flex calls (``flex``, and ``flex kernels`` where the row has one)
    against its reference: the built-in call, or the ``xla`` flex backend on float32
    inputs for a score_mod row: outputs and gradients by relative L2 error."""
    build, small = ROWS[name]
    _, entries = build(**(small if tiny else {}))
    if name == "mask128k":
        return [dict(row=name, skipped="the documents row checks the same call")]
    flex_rows = [e for e in entries if e[0]["as"] in ("flex", "flex kernels", "score_mod")]
    ref = next(e for e in entries if e not in flex_rows)
    return [_check_one(name, entry, ref) for entry in flex_rows]


def _check_one(name: str, entry: tuple, ref: tuple) -> dict:
    row, fn, (q, k, v, d_out), side = entry
    if row["as"] == "score_mod":  # the xla backend, float32, the capture differentiated too
        mask, table = side

        def ref_fn(q, k, v, table):
            f32 = [x.astype(jnp.float32) for x in (q, k, v)]
            score_mod = (_alibi if name == "alibi" else _relative)(table)
            return flex_attention(*f32, score_mod, mask, implementation="xla")

        got_fn = lambda q, k, v, table: fn(q, k, v, mask, table)
        args = (q, k, v, table)
    else:
        ref_fn = lambda q, k, v: ref[1](q, k, v, *(ref[3] if len(ref) > 3 else ()))
        got_fn = lambda q, k, v: fn(q, k, v, *side)
        args = (q, k, v)

    def value_and_grads(f):
        out, pull = jax.vjp(f, *args)
        return (out, *pull(d_out.astype(out.dtype)))

    got = jax.jit(lambda *a: value_and_grads(got_fn))()
    want = jax.jit(lambda *a: value_and_grads(ref_fn))()
    names = ("out", "dq", "dk", "dv", "dtable")[: len(got)]
    errors = {n: _relative_error(g, w) for n, g, w in zip(names, got, want, strict=True)}
    finite = all(bool(np.isfinite(np.asarray(g, np.float32)).all()) for g in got)
    passed = finite and all(e <= BF16_TOL for e in errors.values())
    return dict(row=name, **{"as": row["as"]}, errors=errors, finite=finite, passed=passed)


def run(names: list[str], rounds: int, with_bwd: bool = True, tiny: bool = False) -> list[dict]:
    """Time the rows ``names`` in ``rounds`` interleaved rounds, printing each as JSON."""
    rows = []
    for name in names:
        build, small = ROWS[name]
        flops, entries = build(**(small if tiny else {}))
        cases = [
            contender(
                {"row": name, "impl": "ejk", **row},
                fn,
                args,
                with_bwd and not row.get("build_only"),
                *side,
            )
            for row, fn, args, *side in entries
        ]
        for row in time_rounds(cases, rounds, flops):
            print(json.dumps(row, default=str), flush=True)
            rows.append(row)
    return rows


def _ms(rows: list[dict], row: str, label: str, key: str) -> float | None:
    for r in rows:
        if r["row"] == row and r.get("as") == label and f"{key}_ms" in r:
            return r[f"{key}_ms"]
    return None


def evaluate(rows: list[dict]) -> list[dict]:
    """Issue 62's targets as speed ratios (the reference's time over the contender's)."""
    out = []
    for name, (row, label), (ref_row, ref_label), key, bound in TARGETS:
        got, ref = _ms(rows, row, label, key), _ms(rows, ref_row, ref_label, key)
        if got is None or ref is None:
            out.append(dict(target=name, timing=key, bound=bound, met=None, why="not timed"))
            continue
        ratio = ref / got
        out.append(dict(target=name, timing=key, bound=bound, ratio=ratio, met=ratio >= bound))
    build = _ms(rows, "mask128k", "create_block_mask", "fwd")
    call = _ms(rows, "mask128k", "flex", "fwdbwd")
    if build is not None and call is not None:
        share = build / call
        out.append(dict(target="create_block_mask at T=128k vs one forward+backward",
                        timing="fwd/fwdbwd", bound=0.05, share=share, met=share <= 0.05))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {list(ROWS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-bwd", action="store_true")
    parser.add_argument("--json", default="")
    parser.add_argument("--commit", default="")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--check", action="store_true", help="compare values with references")
    args = parser.parse_args(argv)
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    print("#", jax.devices(), jax.__version__)
    checks = [c for name in names for c in check(name, args.tiny)] if args.check else []
    for c in checks:
        print(json.dumps(c), flush=True)
    rows = run(names, args.rounds, with_bwd=not args.no_bwd, tiny=args.tiny)
    targets = evaluate(rows)
    for t in targets:
        print(json.dumps(t), flush=True)
    if args.json:
        from gpu_conformance import run_info

        info = run_info("bench_flex.py", args.commit)
        info["script"] = "packages/ejk-attention/benchmarks/bench_flex.py"
        with open(args.json, "w") as f:
            result = {**info, "rows": rows, "targets": targets, "checks": checks}
            json.dump(result, f, indent=1, default=str)
    return 0 if all(c.get("passed", True) for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
