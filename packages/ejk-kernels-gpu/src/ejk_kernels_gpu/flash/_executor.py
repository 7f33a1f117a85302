"""`ejk_executor.Kernel` wrappers, so the executor can pick, cache and autotune configs.

Two kernels because the forward and backward configs are tuned apart:
`FlashAttentionForward` times the forward under each forward config;
`FlashAttentionBackward` times forward + backward under each backward config
(with the forward config fixed to the heuristic one, or the one passed as
``config``). Both take exactly `flash_attention`'s arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp

from ejk_executor import Invocation, Kernel
from ejk_sequtils import AttentionRequest, validate_attention

from ._api import flash_attention
from ._config import FlashBackwardConfig, FlashConfig
from ._select import (
    bwd_search_space,
    call_options,
    can_run_gluon_dkdv,
    fwd_search_space,
    gluon_dkdv_tiles,
    offer_gluon,
    offer_warp_specialize,
)

__all__ = ["FlashAttentionBackward", "FlashAttentionForward"]


def _shape_info(inv: Invocation[Any, Any], bias_index: int) -> tuple[int, int, bool]:
    """(head_dim, itemsize, side_inputs) of a call, as the config helpers take them."""
    q = inv.args[0] if inv.args else inv.kwargs["q"]
    bias = inv.args[bias_index] if len(inv.args) > bias_index else inv.kwargs.get("bias")
    kw = inv.kwargs
    side = (
        bias is not None
        or kw.get("segment_ids") is not None
        or kw.get("cu_seqlens_q") is not None
        or (kw.get("dropout_rate") or 0.0) > 0.0
    )
    return int(q.shape[-1]), int(jnp.dtype(q.dtype).itemsize), side


def _warp_specialize(inv: Invocation[Any, Any], bias_index: int) -> bool:
    """Whether the heuristics offer the call the warp-specialised builds on this GPU
    (`offer_warp_specialize`)."""
    head_dim, _, side = _shape_info(inv, bias_index)
    k = inv.args[1] if len(inv.args) > 1 else inv.kwargs["k"]
    kw = inv.kwargs
    plain = not side and kw.get("sliding_window") is None and kw.get("logits_soft_cap") is None
    return offer_warp_specialize(plain, None, int(k.shape[1]), head_dim)


def _gluon(inv: Invocation[Any, Any]) -> bool:
    """Whether the heuristics offer the call the Gluon forward on this GPU (`offer_gluon`)."""
    _, itemsize, _ = _shape_info(inv, 3)
    q = inv.args[0] if inv.args else inv.kwargs["q"]
    scale = inv.kwargs.get("softmax_scale")
    return offer_gluon(
        itemsize=itemsize,
        bias=inv.args[3] if len(inv.args) > 3 else inv.kwargs.get("bias"),
        dropout_rate=float(inv.kwargs.get("dropout_rate") or 0.0),
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
    )


class FlashAttentionForward(Kernel[FlashConfig, Any]):
    """`flash_attention` with its forward config chosen by the executor."""

    name = "ejk_kernels_gpu.flash_attention_fwd"
    version = "4"  # 2: the Gluon forward joined the space; 3: masked calls and head_dim 64/256 too;
    # 4: its three-consumer tile for soft caps
    config_type = FlashConfig
    cached_cfg_in_space = True  # from disk only what the autotuner can have stored

    def run(self, *args: Any, cfg: FlashConfig, **kwargs: Any) -> Any:
        return flash_attention(*args, config=cfg, **kwargs)

    def heuristic_cfg(self, inv: Invocation[FlashConfig, Any]) -> FlashConfig:
        return call_options(_request(inv, ("q", "k", "v", "bias")), None, None).fwd_cfg

    def config_space(self, inv: Invocation[FlashConfig, Any]) -> Iterable[FlashConfig]:
        return fwd_search_space(
            *_shape_info(inv, 3), warp_specialize=_warp_specialize(inv, 3), gluon=_gluon(inv),
            soft_cap=inv.kwargs.get("logits_soft_cap") is not None,
        )  # fmt: skip


class FlashAttentionBackward(Kernel[FlashBackwardConfig, Any]):
    """Gradients of ``sum(flash_attention(...) * d_out)`` w.r.t. q, k, v, timed per backward config.

    ``run(q, k, v, d_out, bias=None, **kwargs)`` returns ``(dq, dk, dv)``.
    """

    name = "ejk_kernels_gpu.flash_attention_bwd"
    version = "3"  # 2: the Gluon dk/dv kernel joined the space; 3: its configs became
    # FlashBackwardConfigs (entries of 2, FlashConfigs, stay on disk under their own keys)
    config_type = FlashBackwardConfig
    cached_cfg_in_space = True  # from disk only what the autotuner can have stored

    def run(self, q, k, v, d_out, bias=None, *, cfg: FlashBackwardConfig, **kwargs: Any) -> Any:
        def fwd(q, k, v):
            return flash_attention(q, k, v, bias, bwd_config=cfg, **kwargs)

        _, vjp = jax.vjp(fwd, q, k, v)
        return vjp(d_out.astype(q.dtype))

    def heuristic_cfg(self, inv: Invocation[FlashBackwardConfig, Any]) -> FlashBackwardConfig:
        return call_options(_bwd_request(inv), None, None).bwd_cfg  # the call's own default

    def config_space(
        self, inv: Invocation[FlashBackwardConfig, Any]
    ) -> Iterable[FlashBackwardConfig]:
        request = _bwd_request(inv)
        opts = call_options(request, None, None)
        kv_len = request.k.shape[1]
        tiles = gluon_dkdv_tiles(request.q.shape[3])
        gluon = can_run_gluon_dkdv(opts, request.bias, request.q, kv_len, tiles)
        return bwd_search_space(
            *_shape_info(inv, 4), gluon=gluon, soft_cap=opts.soft_cap > 0.0, tables=opts.tabled()
        )


def _bwd_request(inv: Invocation[FlashBackwardConfig, Any]) -> AttentionRequest:
    """The validated request of a `FlashAttentionBackward` invocation
    (``(q, k, v, d_out, bias=None, **flash_attention's keywords)``)."""
    return _request(inv, ("q", "k", "v", "d_out", "bias"))


def _request(inv: Invocation[Any, Any], names: tuple[str, ...]) -> AttentionRequest:
    """The validated request of an invocation whose positional arguments are ``names``
    (`flash_attention`'s keywords besides; ``d_out`` and configs dropped)."""
    given = dict(zip(names, inv.args, strict=False)) | inv.kwargs
    given.pop("d_out", None)
    given.pop("config", None)
    given.pop("bwd_config", None)
    return validate_attention(
        given.pop("q"), given.pop("k"), given.pop("v"), given.pop("bias", None), **given
    )
