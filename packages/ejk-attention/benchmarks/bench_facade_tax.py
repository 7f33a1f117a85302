"""What the facade costs: each GPU benchmark shape through `ejk_attention` and `ejk_kernels_gpu`.

Every shape of ejk-kernels-gpu's ``bench_flash.py`` (five headline shapes), ``bench_features.py``
(documents as segment ids and as ``cu_seqlens``, window, soft cap, head_dim 256) and
``bench_decode.py`` (contiguous decode, and paged decode through ``paged_attention``) is timed
through ``ejk_attention`` as a user calls it (``implementation=None``) and through
``ejk_kernels_gpu`` directly, in one process on the same inputs, in interleaved rounds
(ejk-kernels-gpu's ``_timing``); decoding also against cuDNN (``jax.nn``). A row's
``tax`` is facade time / kernel-package time (target <= 1.03, issue 65), decoding's
``vs_cudnn`` cuDNN's time / the facade's (target >= 0.95).

Usage (GPU machine, after ``source scripts/gpu/setup.sh``):
    python3 packages/ejk-attention/benchmarks/bench_facade_tax.py [--cases flash,features,decode]
        [--rounds 7] [--json out.json --commit SHA]
    (--tiny: every case on tiny shapes, to check the script on a CPU.)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

_KERNEL_BENCHMARKS = Path(__file__).resolve().parents[2] / "ejk-kernels-gpu" / "benchmarks"
sys.path.insert(0, str(_KERNEL_BENCHMARKS))

import bench_decode  # noqa: E402
import bench_flash  # noqa: E402
from _inputs import attention_inputs  # noqa: E402
from _timing import contender, time_rounds  # noqa: E402
from _trace import gpu_span_ms  # noqa: E402

import ejk_attention  # noqa: E402
import ejk_kernels_gpu  # noqa: E402

LIMIT = 1.03  # the facade may cost at most 3 % over the kernel package
DECODE_VS_CUDNN = 0.95


def _training_cases(tiny: bool) -> list[tuple[str, tuple, dict]]:
    """``(label, (B, T, N, K, H), flash_attention keywords)`` of the training benchmarks."""
    if tiny:
        return [
            ("flash causal gqa", (1, 64, 4, 2, 16), {"causal": True}),
            ("documents segment_ids", (1, 64, 2, 2, 16), {"causal": True, "documents": 2}),
            ("documents cu_seqlens", (1, 64, 2, 2, 16), {"causal": True, "documents": -2}),
            ("window", (1, 64, 4, 2, 16), {"causal": True, "sliding_window": (16, 0)}),
        ]
    flash = [
        (f"flash {'causal ' if c else ''}{b},{t},{n},{k},{h}", (b, t, n, k, h), {"causal": c})
        for b, t, n, k, h, c in bench_flash.SHAPES
    ]
    gqa = (4, 4096, 32, 8, 128)
    return [
        *flash,
        ("documents segment_ids", (1, 16384, 16, 16, 128), {"causal": True, "documents": 8}),
        ("documents cu_seqlens", (1, 16384, 16, 16, 128), {"causal": True, "documents": -8}),
        ("window (1024, 0)", gqa, {"causal": True, "sliding_window": (1024, 0)}),
        ("soft cap 50", gqa, {"causal": True, "logits_soft_cap": 50.0}),
        ("head_dim 256", (2, 4096, 16, 8, 256), {"causal": True}),
    ]


def _with_documents(kwargs: dict, length: int) -> tuple[dict, tuple]:
    """``kwargs`` without its ``documents`` count and the side input that replaces it:
    segment ids (count > 0) or ``cu_seqlens`` (count < 0) of equal documents, passed to
    the timed function as a jit argument, as in a training step."""
    kwargs = dict(kwargs)
    docs = kwargs.pop("documents", 0)
    if docs > 0:
        return kwargs | {"side": "segment_ids"}, (
            jnp.repeat(jnp.arange(docs, dtype=jnp.int32), length // docs)[None],
        )
    if docs < 0:
        return kwargs | {"side": "cu_seqlens_q"}, (
            jnp.arange(-docs + 1, dtype=jnp.int32) * (length // -docs),
        )
    return kwargs, ()


def _call(fn, kwargs: dict):
    """``fn(q, k, v, *side, **kwargs)`` with the side input passed by its keyword."""
    kwargs = dict(kwargs)
    side = kwargs.pop("side", None)
    if side is None:
        return lambda q, k, v: fn(q, k, v, **kwargs)
    return lambda q, k, v, ids: fn(q, k, v, **kwargs, **{side: ids})


def _timed(cases: list[tuple], rounds: int, trace_calls: int) -> list[dict]:
    """`time_rounds` of ``cases``, and each timed function's lowered program's hash (equal
    hashes: the facade compiles to the kernel package's program, so a tax is timing noise); with ``trace_calls``, each timed function's GPU span and
    kernels by name over that many calls after the rounds (`_trace.gpu_span_ms`), so a tax
    can be told apart as other kernels or as time between them."""
    rows = time_rounds(cases, rounds, 1.0, rotate=True)
    for row, timed, _ in cases:
        for key, f, a, _ in timed:
            program = f.lower(*a).as_text(debug_info=False)
            row[f"{key}_program"] = hashlib.sha256(program.encode()).hexdigest()[:16]
            if trace_calls:
                span, _, kernels, _ = gpu_span_ms(f, a, trace_calls)
                row[f"{key}_gpu_ms"], row[f"{key}_kernels_ms"] = span, kernels
    return rows


def training(
    rounds: int, tiny: bool, groups: set[str], trace_calls: int = 0, match: str = ""
) -> list[dict]:
    """Forward and forward+backward of the training cases of ``groups`` (``flash``: the
    headline shapes, ``features``: the others; only labels holding ``match``) through both
    packages."""
    rows = []
    for label, (b, t, n, kh, h), given in _training_cases(tiny):
        if (
            "flash" if label.startswith("flash") else "features"
        ) not in groups or match not in label:
            continue
        args = attention_inputs(b, t, n, kh, h)
        kwargs, side = _with_documents(given, t)
        cases = [
            contender(
                {"case": label, "impl": impl, "B": b, "T": t, "N": n, "K": kh, "H": h},
                _call(fn, kwargs),
                args,
                True,
                side,
            )
            for impl, fn in (
                ("facade", _facade(ejk_attention.flash_attention, tiny)),
                ("kernels", ejk_kernels_gpu.flash_attention),
            )
        ]
        rows += _taxed(_timed(cases, rounds, trace_calls), ("fwd", "fwdbwd"))
    return rows


def decoding(rounds: int, tiny: bool, trace_calls: int = 0, match: str = "") -> list[dict]:
    """Contiguous decode (``flash_attention``) and paged decode (``paged_attention``, pages
    of 64 in shuffled order) through both packages, and cuDNN on the contiguous cache."""
    import numpy as np

    shapes = [(2, 1024, 4, 1, 16)] if tiny else bench_decode.DECODE_SHAPES
    rows = []
    for b, s, n, kh, h in shapes:
        keys = jax.random.split(jax.random.key(s), 3)
        q = jax.random.normal(keys[0], (b, 1, n, h), jnp.bfloat16)
        k, v = (jax.random.normal(x, (b, s, kh, h), jnp.bfloat16) for x in keys[1:])
        page = 16 if tiny else bench_decode.PAGE
        kp, vp, table = bench_decode.paged_cache(np.random.default_rng(0), k, v, page)
        kv_lens = jnp.full((b,), s, jnp.int32)
        row = {"B": b, "S": s, "N": n, "K": kh, "H": h, "gbps_bytes": 2 * b * s * kh * h * 2}

        contenders = [
            ("contiguous", "facade", _facade(ejk_attention.flash_attention, tiny), (q, k, v)),
            ("contiguous", "kernels", ejk_kernels_gpu.flash_attention, (q, k, v)),
            ("contiguous", "cudnn", _cudnn, (q, k, v)),
            (
                "paged",
                "facade",
                _paged(_facade(ejk_attention.paged_attention, tiny), kv_lens),
                (q, kp, vp, table),
            ),
            (
                "paged",
                "kernels",
                _paged(ejk_kernels_gpu.paged_attention, kv_lens),
                (q, kp, vp, table),
            ),
        ]
        cases = [
            contender(
                {"case": f"decode {kind} {b},{s}", "impl": impl, **row}, fn, (*a, None), False
            )
            for kind, impl, fn, a in contenders
            if not (tiny and impl == "cudnn") and match in f"decode {kind} {b},{s}"
        ]
        if not cases:
            continue
        timed = _timed(cases, rounds, trace_calls)
        for r in timed:
            if "fwd_ms" in r:
                r["gbps"] = r["gbps_bytes"] / (r["fwd_ms"] * 1e-3) * 1e-9
        rows += _taxed(timed, ("fwd",))
        by = {(r["case"], r["impl"]): r for r in rows}
        for r in timed:
            cudnn = by.get((r["case"], "cudnn"))
            if r["impl"] == "facade" and cudnn is not None and "fwd_ms" in cudnn:
                r["vs_cudnn"] = cudnn["fwd_ms"] / r["fwd_ms"]
                r["vs_cudnn_met"] = r["vs_cudnn"] >= DECODE_VS_CUDNN
    return rows


def _paged(fn, kv_lens):
    """``fn(q, k_pages, v_pages, page_table)`` over sequences of ``kv_lens`` tokens."""
    return lambda q, k_pages, v_pages, table: fn(q, k_pages, v_pages, table, kv_lens)


def _facade(fn, tiny: bool):
    """``fn`` as a user calls it (``implementation=None``); on tiny shapes (a CPU, where
    that is XLA) the Triton backend, so the check compares the same kernels."""
    return functools.partial(fn, implementation="triton") if tiny else fn


def _cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")


def _taxed(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """``rows`` with each facade row's ``{key}_tax`` (its time / the kernel package's) and
    whether it is within `LIMIT`; a row that failed is printed with its error."""
    kernels = {r["case"]: r for r in rows if r["impl"] == "kernels"}
    for r in rows:
        base = kernels.get(r["case"])
        if r["impl"] == "facade" and base is not None:
            for key in keys:
                if f"{key}_ms" in r and f"{key}_ms" in base:
                    r[f"{key}_tax"] = r[f"{key}_ms"] / base[f"{key}_ms"]
                    r[f"{key}_best_tax"] = r[f"{key}_best_ms"] / base[f"{key}_best_ms"]
                    r[f"{key}_met"] = r[f"{key}_tax"] <= LIMIT
                    r[f"{key}_same_program"] = r[f"{key}_program"] == base[f"{key}_program"]
        print(json.dumps(r, default=str), flush=True)
    return rows


def _table(rows: list[dict]) -> None:
    print(f"\n{'case':<36}{'fwd tax':>9}{'f+b tax':>9}{'fwd ms':>9}{'vs cuDNN':>10}  same program")
    nan = float("nan")
    for r in rows:
        if r["impl"] != "facade":
            continue
        fwd, fb, vs = (r.get(x, nan) for x in ("fwd_tax", "fwdbwd_tax", "vs_cudnn"))
        same = [r[f"{k}_same_program"] for k in ("fwd", "fwdbwd") if f"{k}_same_program" in r]
        print(
            f"{r['case']:<36}{fwd:>9.3f}{fb:>9.3f}{r.get('fwd_ms', nan):>9.3f}{vs:>10.3f}  {same}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="flash,features,decode", help="which groups to run")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--json", default="", help="write every row, device and versions here")
    parser.add_argument("--commit", default="", help="the commit under test (for the JSON)")
    parser.add_argument("--match", default="", help="only the cases whose label holds this")
    parser.add_argument("--trace", type=int, default=0, help="trace this many calls of each")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU check)")
    args = parser.parse_args(argv)
    wanted = set(args.cases.split(","))

    rows = []
    if wanted & {"flash", "features"}:
        rows += training(args.rounds, args.tiny, wanted, args.trace, args.match)
    if "decode" in wanted:
        rows += decoding(args.rounds, args.tiny, args.trace, args.match)
    _table(rows)
    missed = [r["case"] for r in rows if r.get("fwd_met") is False or r.get("fwdbwd_met") is False]
    differ = [
        r["case"]
        for r in rows
        if r.get("fwd_same_program") is False or r.get("fwdbwd_same_program") is False
    ]
    if args.json:
        from gpu_conformance import run_info

        info = run_info("bench_facade_tax.py", args.commit)
        info["script"] = "packages/ejk-attention/benchmarks/bench_facade_tax.py"
        with open(args.json, "w") as f:
            json.dump(
                {**info, "limit": LIMIT, "missed": missed, "programs_differ": differ, "rows": rows},
                f,
                indent=1,
            )
    print(f"\nfacade within {LIMIT:.2f}x of the kernel package by time: {missed or 'all'}")
    print(f"facade programs unlike the kernel package's: {differ or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
