"""Splash attention's mask module names, mapped to `ejk_kernels_tpu` (names only, no shims).

`mask_lib` stands for ``jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask``
and `mask_info_lib` for ``...splash_attention_mask_info``: every attribute is an
`ejk_kernels_tpu` object under splash's name. `splash_mask_compat.py` installs them in
place of JAX's modules to run JAX's own mask tests against ejk.
"""

from __future__ import annotations

import types

import ejk_kernels_tpu as ejk

MASK_NAMES = {
    "Mask": ejk.Mask,
    "FullMask": ejk.FullMask,
    "CausalMask": ejk.CausalMask,
    "LocalMask": ejk.LocalMask,
    "ChunkedCausalMask": ejk.ChunkedCausalMask,
    "NumpyMask": ejk.NumpyMask,
    "MultiHeadMask": ejk.MultiHeadMask,
    "LogicalAnd": ejk.LogicalAnd,
    "LogicalOr": ejk.LogicalOr,
    "make_causal_mask": ejk.make_causal_mask,
    "make_local_attention_mask": ejk.make_local_attention_mask,
    "make_chunk_attention_mask": ejk.make_chunk_attention_mask,
    "make_random_mask": ejk.make_random_mask,
}

MASK_INFO_NAMES = {
    "MaskInfo": ejk.MaskInfo,
    "process_mask": ejk.process_mask,
    "process_mask_dkv": ejk.process_mask_dkv,
    "process_dynamic_mask": ejk.process_dynamic_mask,
    "process_dynamic_mask_dkv": ejk.process_dynamic_mask_dkv,
    "_check_mask": ejk.check_mask,
}

_PREFIX = "jax.experimental.pallas.ops.tpu.splash_attention."


def _module(name: str, names: dict) -> types.ModuleType:
    module = types.ModuleType(_PREFIX + name, f"ejk_kernels_tpu under splash's {name} names")
    module.__dict__.update(names)
    return module


mask_lib = _module("splash_attention_mask", MASK_NAMES)
mask_info_lib = _module("splash_attention_mask_info", MASK_INFO_NAMES)
