"""`FlexRequest`: a `flex_attention` call checked once, as every flex backend receives it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ejk_sequtils import AttentionRequest, validate_attention

from ._block_mask import BlockMask
from ._evaluate import check_mask_mod, check_score_mod
from ._mods import check_captures

__all__ = ["FlexRequest", "validate_flex"]


@dataclasses.dataclass(frozen=True)
class FlexRequest(AttentionRequest):
    """A checked `flex_attention` call: an `AttentionRequest` (q, k, v, the softmax scale,
    ``return_lse``; none of its own mask options) with the two modifications.

    It is an `AttentionRequest`, so the facade's dispatch (`run_first`) serves it; only
    the flex backends receive one.

    Attributes:
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)``, or None.
        block_mask: the `BlockMask` whose mask_mod hides keys, or None (every key visible).
    """

    score_mod: Callable[..., Any] | None = None
    block_mask: BlockMask | None = None

    @property
    def mask_mod(self) -> Callable[..., Any] | None:
        """The block mask's mask_mod, or None."""
        return None if self.block_mask is None else self.block_mask.mask_mod


def validate_flex(
    q: Any,
    k: Any,
    v: Any,
    score_mod: Any,
    block_mask: Any,
    *,
    softmax_scale: Any,
    return_lse: Any,
) -> FlexRequest:
    """Check a `flex_attention` call and return it as a `FlexRequest`.

    Raises:
        TypeError: an argument of the wrong kind or dtype, a mod returning a wrong dtype.
        ValueError: a wrong shape (q, k, v, a block mask built for another call, a captured
            array), a mod that fails on scalars or returns another shape.
    """
    attention = validate_attention(q, k, v, softmax_scale=softmax_scale, return_lse=return_lse)
    batch, q_len, kv_len, heads, *_ = attention.shape
    if score_mod is not None:
        check_score_mod(score_mod, "flex_attention")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(
                "flex_attention: block_mask must be a BlockMask (build one with "
                f"create_block_mask(mask_mod, B, N, T, S)), got {block_mask!r}"
            )
        want = (batch, heads, q_len, kv_len)
        for name, built, call in zip("BNTS", block_mask.shape, want, strict=True):
            if built is not None and built != call:
                raise ValueError(
                    f"flex_attention: block_mask was built for {name}={built}, the call has "
                    f"{name}={call} (block_mask.shape={block_mask.shape}, (B, N, T, S) of "
                    f"q, k = {want})"
                )
        check_mask_mod(block_mask.mask_mod, "flex_attention")
        check_captures(block_mask.mask_mod, "flex_attention", batch, q_len, kv_len)
    fields = {f.name: getattr(attention, f.name) for f in dataclasses.fields(attention)}
    return FlexRequest(**fields, score_mod=score_mod, block_mask=block_mask)
