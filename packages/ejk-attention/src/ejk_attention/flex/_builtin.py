"""ejk's own mask_mods as `flash_attention`'s mask arguments, for the built-in kernels.

`causal_mask`, `sliding_window_mask` and `document_mask` mean exactly what ``causal``,
``sliding_window`` and ``segment_ids`` mean in `flash_attention` (top-left causal, keys in
``[i - left, i + right]``, equal ids >= 0), and `and_masks` of them is all of them at
once. A flex call with such a mask and no score_mod is the same call as `flash_attention`
with those arguments, whose kernels read key ranges and id tables instead of a block list
and a generated mask function. The `triton` flex backend runs such calls there
(docs/performance.md, "Flex attention", has both paths' figures).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.tree_util import Partial

from ejk_sequtils import AttentionRequest, validate_attention

from . import _mods
from ._request import FlexRequest

__all__ = ["builtin_masks", "builtin_request"]


def builtin_masks(mask_mod: Any) -> dict[str, Any] | None:
    """`flash_attention`'s ``causal`` / ``sliding_window`` / ``segment_ids`` equal to
    ``mask_mod``, or None when it is anything else (a user's function, `or_masks`, a
    prefix, two masks of one kind)."""
    if not isinstance(mask_mod, Partial):
        return None
    func, args = mask_mod.func, mask_mod.args
    if func is _mods._causal:
        return {"causal": True}
    if isinstance(func, _mods._Window):
        return {"sliding_window": (func.left, func.right)}
    if func is _mods._document:
        return {"segment_ids": args}
    if func is _mods._all_of:
        merged: dict[str, Any] = {}
        for inner in args[0]:
            part = builtin_masks(inner)
            if part is None or merged.keys() & part.keys():
                return None
            merged |= part
        return merged
    return None


def builtin_request(request: FlexRequest) -> AttentionRequest | None:
    """``request`` as a `flash_attention` request (the same outputs and gradients), or None
    when its mods are not ejk's own masks alone."""
    if request.score_mod is not None:
        return None
    masks = {} if request.mask_mod is None else builtin_masks(request.mask_mod)
    if masks is None:
        return None
    batch, q_len, kv_len = request.shape[:3]
    if "segment_ids" in masks:
        q_ids, kv_ids = masks["segment_ids"]
        rows = lambda ids, length: jnp.broadcast_to(jnp.reshape(ids, (-1, length)), (batch, length))
        masks["segment_ids"] = (rows(q_ids, q_len), rows(kv_ids, kv_len))
    return validate_attention(
        request.q, request.k, request.v, softmax_scale=request.softmax_scale,
        return_lse=request.return_lse, **masks,
    )  # fmt: skip
