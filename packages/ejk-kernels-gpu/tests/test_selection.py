"""Pins which build and which config every call of a representative grid gets.

The selection policy (forward and backward heuristics, the dq kernel beside the Gluon
dk/dv kernel, search spaces, the warp-specialised / Gluon / ordinary twin choice at
launch, the decode route, context-parallel blocks' options, the paged heuristic) is
pinned two ways:

- the pure functions over the whole product of their arguments, as one digest
  (`PURE_DIGEST`; `python tests/test_selection.py --list` prints the listing it hashes,
  to diff against the listing of the commit that wrote it);
- every kernel launch of ``jax.grad`` of a call (kernel, grid, shapes, constexprs, warps,
  stages, zeroed outputs, aliases), traced abstractly with stand-in outputs, on a
  pretended Hopper and off it, and of the call alone (the decode route's split-KV
  kernel runs only there), against ``selection_launches.json.gz`` beside this file
  (``--write`` rewrites it).

A refactoring of the selection must leave both unchanged.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import ejk_kernels_gpu
from ejk_executor import Invocation
from ejk_kernels_gpu import flash, paged
from ejk_kernels_gpu.build import _triton
from ejk_kernels_gpu.context import BlockMasks, block_options
from ejk_sequtils import validate_attention

LAUNCHES = pathlib.Path(__file__).with_name("selection_launches.json.gz")
# sha256 of `pure_listing()` on the commit that added this test, rewritten when the backward's
# configs became `FlashBackwardConfig`s (the listing's reprs alone changed: every
# ``FlashBackwardConfig(block_keys=a, block_queries=b, ...)`` read back as
# ``FlashConfig(block_q=a, block_k=b, ...)`` gives the listing of the old digest).
PURE_DIGEST = "9f60c88161a04c2dc9097628657bf8e0bfeda46a892010c3b28c0415db8fb8c6"


def _cfg(cfg: Any) -> str | None:
    return None if cfg is None else repr(cfg)


def pure_listing() -> list[str]:
    """The pure selection functions over the product of their arguments, one line each."""
    lines = []
    dims = (16, 32, 40, 64, 80, 96, 128, 192, 256)
    flags = (False, True)
    for hd, item, side, ws, gluon, short, windowed, cap, tabled in itertools.product(
        dims, (1, 2, 4), flags, flags, (None, False, True), flags, flags, flags, flags
    ):
        cfg = flash.fwd_heuristic(
            hd, item, side, warp_specialize=ws, gluon=gluon, short_loops=short,
            windowed=windowed, soft_cap=cap, tabled=tabled,
        )  # fmt: skip
        lines.append(f"fwd {hd} {item} {side} {ws} {gluon} {short} {windowed} {cap} {tabled}: "
                     f"{_cfg(cfg)}")  # fmt: skip
    for hd, item, side, group, cap, gluon, tables in itertools.product(
        dims, (1, 2, 4), flags, (1, 2, 8), flags, flags, flags
    ):
        cfg = flash.bwd_heuristic(hd, item, side, group, soft_cap=cap, gluon=gluon, tables=tables)
        lines.append(f"bwd {hd} {item} {side} {group} {cap} {gluon} {tables}: {_cfg(cfg)}")
        beside = _dq_beside(cfg, hd, cap, tables)
        lines.append(f"dq {hd} {item} {side} {group} {cap} {gluon} {tables}: {_cfg(beside)}")
    for hd, item, side, ws, gluon, cap in itertools.product(
        dims, (2, 4), flags, flags, (None, False, True), flags
    ):
        space = flash.fwd_search_space(hd, item, side, ws, gluon, cap)
        lines.append(f"fwd space {hd} {item} {side} {ws} {gluon} {cap}: "
                     + ", ".join(map(repr, space)))  # fmt: skip
    for hd, item, side, gluon, cap, tables in itertools.product(
        dims, (2, 4), flags, flags, flags, flags
    ):
        space = flash.bwd_search_space(hd, item, side, gluon, cap, tables)
        lines.append(f"bwd space {hd} {item} {side} {gluon} {cap} {tables}: "
                     + ", ".join(map(repr, space)))  # fmt: skip
    for batch, q_len, ragged, heads, kv_heads, hd, capacity, item in itertools.product(
        (1, 8, 64), (1, 4, 33), flags, (8, 32), (1, 8), (64, 128, 256), (256, 8192, 131072), (1, 2)
    ):
        cfg = paged.paged_heuristic(
            batch=batch, q_len=q_len, ragged=ragged, heads=heads, kv_heads=kv_heads,
            head_dim=hd, capacity=capacity, itemsize=item,
        )  # fmt: skip
        lines.append(f"paged {batch} {q_len} {ragged} {heads} {kv_heads} {hd} {capacity} {item}: "
                     f"{cfg!r}")  # fmt: skip
        space = paged.paged_search_space(
            group=heads // kv_heads, max_q_len=q_len, max_keys=capacity, head_dim=hd,
            itemsize=item,
        )  # fmt: skip
        lines.append(f"paged space {batch} {q_len} {ragged} {heads} {kv_heads} {hd} {capacity} "
                     f"{item}: " + ", ".join(map(repr, space)))  # fmt: skip
    return lines


def _dq_beside(bwd, head_dim: int, soft_cap: bool, tabled: bool):
    from ejk_kernels_gpu.flash import _select

    return _select.dq_beside(bwd, head_dim, soft_cap, tabled=tabled)


# (name, flash_attention keywords besides q, k, v) of the mask and feature cases.
_FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"sliding_window": (64, 0)},
    "causal_window": {"causal": True, "sliding_window": (100, 0)},
    "segments": {"segment_ids": "segments"},
    "causal_segments": {"causal": True, "segment_ids": "segments"},
    "packed": {"causal": True, "cu_seqlens_q": "packed"},
    "bias": {"bias": True},
    "cap": {"logits_soft_cap": 30.0},
    "causal_cap": {"causal": True, "logits_soft_cap": 30.0},
    "window_cap": {"sliding_window": (64, 0), "logits_soft_cap": 20.0},
    "dropout": {"dropout_rate": 0.1, "dropout_seed": 3},
    "sinks": {"causal": True, "softmax_sinks": True},
}


def _cases() -> list[tuple]:
    """(dtype, head_dim, heads, kv_heads, q_len, kv_len, feature) of the launch grid."""
    cases = [
        ("bfloat16", hd, heads, 2, 512, 512, feature)
        for hd, heads, feature in itertools.product((64, 128, 256), (2, 8), _FEATURES)
    ]
    cases += [
        ("float32", hd, 4, 4, 256, 256, feature)
        for hd, feature in itertools.product((64, 128), ("plain", "causal", "cap", "segments"))
    ]
    cases += [
        ("float16", 128, 4, 4, 256, 256, "causal_cap"),
        ("bfloat16", 40, 4, 2, 200, 300, "plain"),
        ("bfloat16", 40, 4, 2, 200, 200, "causal"),
        ("bfloat16", 128, 4, 4, 200, 300, "plain"),
        ("bfloat16", 128, 4, 4, 192, 320, "causal_window"),
        ("bfloat16", 64, 4, 4, 200, 200, "causal"),
        ("bfloat16", 256, 4, 4, 200, 200, "causal"),
        ("bfloat16", 128, 4, 4, 4096, 16384, "causal"),
        ("bfloat16", 128, 2, 2, 16384, 16384, "causal"),
        ("bfloat16", 64, 2, 2, 16384, 16384, "plain"),
        ("bfloat16", 128, 32, 8, 1, 4096, "plain"),
        ("bfloat16", 128, 32, 8, 1, 4096, "causal"),
        ("bfloat16", 64, 16, 1, 4, 2048, "cap"),
        ("float32", 128, 8, 8, 1, 8192, "sinks"),
    ]
    return cases


def _call_keywords(case: tuple) -> tuple[dict, tuple]:
    dtype, hd, heads, kv_heads, q_len, kv_len, feature = case
    batch = 1 if "cu_seqlens_q" in _FEATURES[feature] else 2
    q = jax.ShapeDtypeStruct((batch, q_len, heads, hd), jnp.dtype(dtype))
    kv = jax.ShapeDtypeStruct((batch, kv_len, kv_heads, hd), jnp.dtype(dtype))
    kwargs = dict(_FEATURES[feature])
    arrays = {"q": q, "k": kv, "v": kv}
    if kwargs.pop("bias", False):
        arrays["bias"] = jax.ShapeDtypeStruct((batch, heads, q_len, kv_len), jnp.dtype(dtype))
    if kwargs.pop("softmax_sinks", False):
        arrays["softmax_sinks"] = jax.ShapeDtypeStruct((heads,), jnp.float32)
    return kwargs, arrays


def _concrete(kwargs: dict, q_len: int, kv_len: int, batch: int) -> dict:
    out = dict(kwargs)
    if out.get("segment_ids") == "segments":
        ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), -(-q_len // 4))[:q_len]
        out["segment_ids"] = jnp.broadcast_to(ids, (batch, q_len))
    if out.get("cu_seqlens_q") == "packed":
        third = q_len // 3
        out["cu_seqlens_q"] = jnp.array([0, third, 2 * third, q_len], jnp.int32)
    return out


def _launches(case: tuple, monkeypatch, hopper: bool) -> list:
    """Every launch of one call and of ``jax.grad`` of it, traced abstractly."""
    kwargs, arrays = _call_keywords(case)
    q_len, kv_len = case[4], case[5]
    batch = arrays["q"].shape[0]
    seen: list = []

    def spy(kernel, grid, inputs, outs, consts, **options):
        seen.append(_launch_record(kernel, grid, inputs, outs, consts, options))
        return tuple(jnp.zeros(o.shape, o.dtype) for o in outs)

    _patch(monkeypatch, hopper=hopper, launch=spy)
    names = tuple(arrays)

    def loss(*values):
        given = dict(zip(names, values, strict=True))
        request = validate_attention(
            given.pop("q"), given.pop("k"), given.pop("v"), given.pop("bias", None),
            **given, **_concrete(kwargs, q_len, kv_len, batch),
        )  # fmt: skip
        return ejk_kernels_gpu.attention(request).astype(jnp.float32).sum()

    jax.eval_shape(loss, *arrays.values())
    seen.append("grad")
    jax.eval_shape(jax.grad(loss, argnums=tuple(range(len(names)))), *arrays.values())
    return seen


def _chosen(case: tuple, monkeypatch, hopper: bool) -> dict:
    """What the executor kernels offer a call (heuristic config, search space) and the
    options of the call as a context-parallel block (relative or local positions)."""
    kwargs, arrays = _call_keywords(case)
    q_len, kv_len = case[4], case[5]
    batch = arrays["q"].shape[0]
    _patch(monkeypatch, hopper=hopper, launch=_triton.launch)
    seen: dict = {}

    def record(*values):
        given = dict(zip(arrays, values, strict=True))
        keywords = {k: v for k, v in given.items() if k not in ("q", "k", "v")}
        keywords |= _concrete(kwargs, q_len, kv_len, batch)
        q, k, v = given["q"], given["k"], given["v"]
        for kernel, args in (
            (ejk_kernels_gpu.FlashAttentionForward(), (q, k, v)),
            (ejk_kernels_gpu.FlashAttentionBackward(), (q, k, v, q)),
        ):
            inv = Invocation.make(kernel, args, keywords, platform="triton", device_fp="pinned")
            seen[kernel.name] = repr(kernel.heuristic_cfg(inv))
            seen[kernel.name + " space"] = list(map(repr, kernel.config_space(inv)))
        masks = dict(
            scale=0.125, causal=bool(kwargs.get("causal")), window=kwargs.get("sliding_window"),
            soft_cap=kwargs.get("logits_soft_cap"), dropout_rate=kwargs.get("dropout_rate", 0.0),
        )  # fmt: skip
        for relative, segments in itertools.product((False, True), (False, True)):
            if relative and not (masks["causal"] or masks["window"] is not None):
                continue
            opts = block_options(BlockMasks(**masks, relative=relative), q, k, v, segments)
            seen[f"block relative={relative} segments={segments}"] = repr(opts)

    jax.eval_shape(record, *arrays.values())
    return seen


def _launch_record(kernel, grid, inputs, outs, consts, options) -> dict:
    def spec(x):
        return f"{x.dtype}{list(x.shape)}"

    return dict(
        kernel=kernel.__name__,
        grid=list(grid),
        inputs=[spec(x) for x in inputs],
        outs=[spec(x) for x in outs],
        consts={k: repr(v) for k, v in sorted(consts.items())},
        num_warps=options["num_warps"],
        num_stages=options["num_stages"],
        zeroed=list(options.get("zeroed") or ()) or [False] * len(outs),
        aliases={str(k): v for k, v in sorted((options.get("aliases") or {}).items())},
    )


def _patch(monkeypatch, *, hopper: bool, launch) -> None:
    """Pretend (or not) to be on Hopper and route every launch to ``launch``, in each
    module of the package that took the names."""
    original = _triton.launch
    for name, module in list(sys.modules.items()):
        if not name.startswith("ejk_kernels_gpu") or module is None:
            continue
        if getattr(module, "hopper_gpu", None) is not None:
            monkeypatch.setattr(module, "hopper_gpu", lambda: hopper)
        if getattr(module, "launch", None) is original:
            monkeypatch.setattr(module, "launch", launch)


def _case_id(case: tuple) -> str:
    return "-".join(map(str, case))


def all_launches(monkeypatch) -> dict:
    return {
        f"{_case_id(case)}-{'hopper' if hopper else 'other'}": dict(
            launches=_launches(case, monkeypatch, hopper),
            chosen=_chosen(case, monkeypatch, hopper),
        )
        for case in _cases()
        for hopper in (False, True)
    }


def test_pure_selection_unchanged():
    """The heuristics, dq-beside choice, search spaces and paged heuristic, over the product
    of their arguments, hash as on the commit that added this test."""
    listing = "\n".join(pure_listing())
    assert hashlib.sha256(listing.encode()).hexdigest() == PURE_DIGEST


def test_launches_unchanged(monkeypatch):
    """Every launch of a call's forward and backward, on Hopper and off it, what the executor
    kernels offer it and its options as a context-parallel block, as pinned."""
    want = json.loads(gzip.decompress(LAUNCHES.read_bytes()))
    for case in want.values():  # (written when a launch without ``zeroed`` meant all False)
        for launch in case["launches"]:
            if launch != "grad" and not launch["zeroed"]:
                launch["zeroed"] = [False] * len(launch["outs"])
    got = all_launches(monkeypatch)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key] == want[key], key


if __name__ == "__main__":
    if "--list" in sys.argv:
        print("\n".join(pure_listing()))
    elif "--write" in sys.argv:
        mp = pytest.MonkeyPatch()
        try:
            text = json.dumps(all_launches(mp), indent=1, sort_keys=True) + "\n"
            LAUNCHES.write_bytes(gzip.compress(text.encode(), mtime=0))
        finally:
            mp.undo()
        print(hashlib.sha256("\n".join(pure_listing()).encode()).hexdigest())


def test_every_rule_gives_its_reason_and_figure():
    """Each row of the decision tables names its build, gives a one-line reason and a figure
    that exists in the repository (a file, and a heading of it where an anchor is given)."""
    from ejk_kernels_gpu.flash import _select

    root = pathlib.Path(__file__).parents[3]
    for rules in (_select.FORWARD_RULES, _select.BACKWARD_RULES, _select.DQ_RULES):
        for rule in rules:
            assert rule.name and rule.reason and "\n" not in rule.reason, rule
            path, _, anchor = rule.figure.partition("#")
            assert (root / path).is_file(), rule.figure
            if anchor:
                headings = [
                    line.lstrip("#").strip().lower()
                    for line in (root / path).read_text().splitlines()
                    if line.startswith("#")
                ]
                slugs = {"".join(c for c in h.replace(" ", "-") if c.isalnum() or c in "-_")
                         for h in headings}  # fmt: skip
                assert anchor in slugs, rule.figure
