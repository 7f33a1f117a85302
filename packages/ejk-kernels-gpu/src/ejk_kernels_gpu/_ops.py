"""`flash_attention`: validation, auxiliary tables, kernel launches and the custom VJP."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Integer

from . import _masks
from ._config import FlashConfig, bwd_heuristic, fwd_heuristic, head_block, ordinary_config
from ._launch_fix import scratch_bytes
from ._triton import hopper_gpu, launch

__all__ = ["flash_attention"]

AnyArray = Array | np.ndarray
_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class _Static:
    """Every static option of one call (hashable: the custom_vjp's non-differentiable part)."""

    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float
    dropout_rate: float
    has_seg: bool
    varlen: bool
    fwd_cfg: FlashConfig
    bwd_cfg: FlashConfig

    def fully_visible(self) -> bool:
        """Whether every query sees every key (nothing masks a block; bias aside)."""
        return not (
            self.causal or self.window is not None or self.has_seg or self.varlen
        ) and self.dropout_rate == 0.0 and self.soft_cap == 0.0  # fmt: skip

    def side_inputs(self, bias: Any) -> bool:
        """Whether tiles of side inputs (bias, segment ids, packed offsets, dropout) need
        shared memory too: the heuristics and `ordinary_config` leave room for them."""
        return bias is not None or self.has_seg or self.varlen or self.dropout_rate > 0.0

    def ws_masks(self) -> bool:
        """Whether the warp-specialised loop can do this call's masking: none, or causal alone."""
        return self.fully_visible() or (
            self.causal and dataclasses.replace(self, causal=False).fully_visible()
        )


def can_warp_specialize(
    masks_ok: bool, bias: Any, kv_len: int, head_dim: int, block_k: int
) -> bool:
    """Whether a call may run the warp-specialised TMA loops (see `FlashConfig`).

    ``masks_ok``: its masking is none or causal alone (`_Static.ws_masks`). The loop has
    no bounds masks, so every key block must be full (and there must be one); TMA needs
    16-byte aligned rows (power-of-two head_dim).
    """
    return (
        masks_ok
        and bias is None
        and kv_len > 0
        and kv_len % block_k == 0
        and head_dim == head_block(head_dim)
        and hopper_gpu()
    )


def offer_warp_specialize(masks_ok: bool, bias: Any, kv_len: int, head_dim: int) -> bool:
    """Whether the heuristics and the tuning space offer a call the warp-specialised builds
    (forward and backward): ``masks_ok`` (nothing masked, or causal alone) and the call can
    take them with the 128-key tiles of their configs (`can_warp_specialize`)."""
    return can_warp_specialize(masks_ok, bias, kv_len, head_dim, 128)


def can_run_gluon(st: _Static, bias: Any, q: Any, kv_len: int) -> bool:
    """Whether a call may run the Gluon forward (`_gluon_forward`): what the
    warp-specialised loop takes, with head_dim 128, 16-bit inputs, a positive scale and
    at least one query."""
    return (
        q.shape[3] == 128
        and q.dtype.itemsize == 2
        and q.shape[1] > 0
        and st.scale > 0.0
        and can_warp_specialize(st.ws_masks(), bias, kv_len, 128, 128)
    )


def runnable_config(
    st: _Static,
    cfg: FlashConfig,
    bias: Any,
    q: Any,
    kv_len: int,
    block: int,
    kinds: tuple[str, ...],
) -> tuple[FlashConfig, bool]:
    """(config, special) a launch runs: ``cfg`` where the call can take its warp-specialised
    or Gluon build (``special``), else its ordinary twin (`ordinary_config`) for ``kinds``.
    ``block``: the streamed key tile (forward) or the resident one (backward)."""
    head_dim = q.shape[3]
    if cfg.gluon:
        special = can_run_gluon(st, bias, q, kv_len)
    else:
        masks = st.ws_masks()
        special = cfg.warp_specialize and can_warp_specialize(masks, bias, kv_len, head_dim, block)
    if not special:
        cfg = ordinary_config(cfg, head_dim, q.dtype.itemsize, st.side_inputs(bias), kinds)
    return cfg, special


def _window(sliding_window: int | Sequence[int] | None) -> tuple[int, int] | None:
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool):
        raise TypeError(f"sliding_window must be an int or (left, right), got {sliding_window!r}")
    if isinstance(sliding_window, int):
        pair: Sequence[int] = (sliding_window, sliding_window)
    else:
        pair = tuple(sliding_window)
    if len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair):
        raise ValueError(f"sliding_window must be an int or (left, right), got {sliding_window!r}")
    if pair[0] < 0 or pair[1] < 0:
        raise ValueError(f"sliding_window sizes must be >= 0, got {sliding_window!r}")
    return int(pair[0]), int(pair[1])


def _seed_array(seed: int | ArrayLike | None) -> Array:
    if seed is None:
        return jnp.zeros((1,), jnp.uint32)
    if isinstance(seed, bool):
        raise TypeError(f"dropout_seed must be an int or a uint32/int32 scalar, got {seed!r}")
    if isinstance(seed, int):
        return jnp.full((1,), seed & 0xFFFFFFFF, jnp.uint32)
    seed = jnp.asarray(seed)
    if seed.shape != ():
        raise ValueError(f"dropout_seed must be a scalar, got shape {seed.shape}")
    if seed.dtype == jnp.uint32:
        return seed.reshape(1)
    if seed.dtype == jnp.int32:
        return jax.lax.bitcast_convert_type(seed, jnp.uint32).reshape(1)
    raise TypeError(f"dropout_seed must be an int or a uint32/int32 scalar, got dtype {seed.dtype}")


def _dummy(dtype: object = jnp.int32) -> Array:
    return jnp.zeros((1,), dtype)


@dataclasses.dataclass(frozen=True)
class _Tables:
    """Integer side inputs of the kernels (not differentiated)."""

    q_sid: Any  # jax arrays; float0 zeros when JAX builds their tangents
    k_sid: Any
    q_pos: Any
    k_pos: Any
    q_seg: Any
    k_seg: Any
    fwd_ranges: Any
    dq_ranges: Any
    dkdv_ranges: Any
    seed: Any


jax.tree_util.register_dataclass(
    _Tables,
    data_fields=[f.name for f in dataclasses.fields(_Tables)],
    meta_fields=[],
)


def _tables(
    st: _Static,
    q_len: int,
    kv_len: int,
    segment_ids: tuple[Array, Array] | None,
    cu: tuple[Array, Array] | None,
    seed: Array,
) -> _Tables:
    packing = None if cu is None else _masks.Packing(cu[0], cu[1], q_len, kv_len)
    rlo, rhi = _masks.ranges(q_len, kv_len, st.causal, st.window, packing, of_queries=True)
    clo, chi = _masks.ranges(q_len, kv_len, st.causal, st.window, packing, of_queries=False)
    exact = not st.has_seg
    fwd = _masks.block_table(rlo, rhi, st.fwd_cfg.block_q, st.fwd_cfg.block_k, exact)
    dq = _masks.block_table(rlo, rhi, st.bwd_cfg.block_q, st.bwd_cfg.block_k, exact)
    # dk/dv programs own key blocks of block_q rows (the resident tile) and stream block_k queries.
    dkdv = _masks.block_table(clo, chi, st.bwd_cfg.block_q, st.bwd_cfg.block_k, exact)
    if packing is None:
        q_sid = k_sid = q_pos = k_pos = _dummy()
    else:
        q_sid, k_sid = packing.q_sid, packing.k_sid
        q_pos, k_pos = packing.q_pos.astype(jnp.int32), packing.k_pos.astype(jnp.int32)
    if segment_ids is None:
        q_seg = k_seg = _dummy()
    else:
        q_seg, k_seg = segment_ids
    return _Tables(q_sid, k_sid, q_pos, k_pos, q_seg, k_seg, fwd, dq, dkdv, seed)


def _common_constexprs(st: _Static, q: Array, k: Array, bias: Array | None, has_sinks: bool):
    batch, q_len, heads, head_dim = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if bias is None:
        bias_sb = bias_sn = 0
    else:
        bias_sb = bias.shape[1] * q_len * kv_len if bias.shape[0] == batch else 0
        bias_sn = q_len * kv_len if bias.shape[1] == heads else 0
    left, right = st.window if st.window is not None else (-1, -1)
    return dict(
        T=q_len,
        S=kv_len,
        N=heads,
        G=heads // kv_heads,
        H=head_dim,
        BIAS_SB=bias_sb,
        BIAS_SN=bias_sn,
        SCALE=float(st.scale),
        SOFT_CAP=float(st.soft_cap),
        HAS_BIAS=bias is not None,
        HAS_SINKS=has_sinks,
        VARLEN=st.varlen,
        HAS_SEG=st.has_seg,
        CAUSAL=st.causal,
        WINDOW_LEFT=left,
        WINDOW_RIGHT=right,
        DROPOUT_THRESHOLD=round(st.dropout_rate * (1 << 24)),
        DROPOUT_SCALE=float(1.0 / (1.0 - st.dropout_rate)),
        # See _common: the plain case folds log2(e) into the scale of q·kᵀ.
        LOG2_FACTOR=(
            st.scale * _LOG2E if bias is None and st.soft_cap == 0.0 and st.scale > 0.0 else _LOG2E
        ),
        BLOCK_D=head_block(head_dim),
    )


def gluon_constexprs(st: _Static, q: Any, k: Any, has_sinks: bool, cfg: FlashConfig):
    """The constexpr arguments of `_gluon_forward.gluon_fwd_kernel`."""
    _, q_len, heads, head_dim = q.shape
    return dict(
        T=q_len, S=k.shape[1], N=heads, G=heads // k.shape[2], H=head_dim,
        QK=float(st.scale * _LOG2E), CAUSAL=st.causal, HAS_SINKS=has_sinks,
        BM=cfg.block_q, BN=cfg.block_k, STAGES=cfg.num_stages,
    )  # fmt: skip


def _gluon_forward(st: _Static, q, k, v, sinks, cfg: FlashConfig) -> tuple[Array, Array]:
    """(out, lse) from the Gluon forward (`can_run_gluon` holds)."""
    batch, q_len, heads, _ = q.shape
    grid = (-(-q_len // cfg.block_q), batch * heads)
    out, lse, _ = launch(
        "gluon_fwd_kernel",
        grid,
        (q, k, v, _dummy(jnp.float32) if sinks is None else sinks),
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
            jax.ShapeDtypeStruct((scratch_bytes(grid),), jnp.uint8),  # TMA descriptors
        ),
        gluon_constexprs(st, q, k, sinks is not None, cfg),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, lse


def _forward(st: _Static, q, k, v, bias, sinks, tb: _Tables) -> tuple[Array, Array]:
    """(out, lse)."""
    batch, q_len, heads, _ = q.shape
    cfg, ws = runnable_config(st, st.fwd_cfg, bias, q, k.shape[1], st.fwd_cfg.block_k, ("fwd",))
    if cfg.gluon:
        return _gluon_forward(st, q, k, v, sinks, cfg)
    consts = _common_constexprs(st, q, k, bias, sinks is not None)
    grid = (-(-q_len // cfg.block_q), batch * heads)
    out, lse, _ = launch(
        "fwd_kernel",
        grid,
        (
            q,
            k,
            v,
            _dummy(q.dtype) if bias is None else bias,
            _dummy(jnp.float32) if sinks is None else sinks,
            tb.q_sid,
            tb.k_sid,
            tb.q_pos,
            tb.k_pos,
            tb.q_seg,
            tb.k_seg,
            tb.fwd_ranges,
            tb.seed,
        ),
        (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            # The warp-specialised build stores each lse 16 times (a TMA tile, see _forward).
            jax.ShapeDtypeStruct((batch, heads, q_len, *((16,) if ws else ())), jnp.float32),
            # Global scratch for the TMA descriptors (see _launch_fix); unused otherwise.
            jax.ShapeDtypeStruct((scratch_bytes(grid) if ws else 1,), jnp.uint8),
        ),
        dict(consts, BLOCK_M=cfg.block_q, BLOCK_N=cfg.block_k, WS=ws),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, (lse[..., 0] if ws else lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, bias, sinks, tb: _Tables):
    return _forward(st, q, k, v, bias, sinks, tb)


def _attention_fwd(st: _Static, q, k, v, bias, sinks, tb: _Tables):
    out, lse = _forward(st, q, k, v, bias, sinks, tb)
    return (out, lse), (q, k, v, bias, sinks, tb, out, lse)


def _attention_bwd(st: _Static, res, cts):
    from ._backward_ops import backward

    q, k, v, bias, sinks, tb, out, lse = res
    d_out, d_lse = cts  # lse feeds ring attention's merge, so its cotangent counts too
    dq, dk, dv, dbias, dsinks = backward(st, q, k, v, bias, sinks, tb, out, lse, d_out, d_lse)
    return dq, dk, dv, dbias, dsinks, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    bias: Float[AnyArray, "#B #N T S"] | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | Sequence[int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N"] | None = None,
    segment_ids: Int[AnyArray, "B T"]
    | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]
    | None = None,
    cu_seqlens_q: Int[AnyArray, " L"] | None = None,
    cu_seqlens_k: Int[AnyArray, " L"] | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[ArrayLike, ""] | None = None,
    return_lse: bool = False,
    config: FlashConfig | None = None,
    bwd_config: FlashConfig | None = None,
) -> Float[Array, "B T N H"] | tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Flash attention in Triton (FlashAttention-2), forward and backward kernels.

    Same semantics as ``ejk_sequtils.reference_attention``: softmax over the keys
    each query sees, computed blockwise with an online softmax in float32.

    Args:
        q: queries ``[B, T, N, H]`` (float16, bfloat16 or float32).
        k: keys ``[B, S, K, H]`` with ``N % K == 0``; query head n reads kv head ``n // (N // K)``.
        v: values ``[B, S, K, H]``.
        bias: additive logits bias ``[1|B, 1|N, T, S]``.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        causal: query i sees keys ``j <= i`` (top-left aligned; local to a packed sequence).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``: keys in ``[i - left, i + right]``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` one logit per query head in the softmax denominator only.
        segment_ids: ``[B, T]`` (needs ``T == S``) or ``(q_ids [B, T], kv_ids [B, S])``;
            negative ids are padding (0 is an ordinary segment).
        cu_seqlens_q: int32 ``[num_seqs + 1]`` offsets of packed query sequences (needs B == 1).
        cu_seqlens_k: int32 ``[num_seqs + 1]`` key offsets; default ``cu_seqlens_q``.
        dropout_rate: probability of dropping a normalised attention weight, in ``[0, 1)``.
        dropout_seed: int or uint32/int32 scalar seed of the counter-hash keep mask.
        return_lse: also return the float32 log-sum-exp ``[B, N, T]``.
        config: forward tile config; default `fwd_heuristic`.
        bwd_config: backward tile config (dq and dk/dv kernels); default `bwd_heuristic`.

    Returns:
        ``out [B, T, N, H]`` in ``q.dtype``; with ``return_lse`` the pair ``(out, lse)``.
    """
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v must be rank 4 [B, T, N, H]; got {q.shape=}, {k.shape=}, {v.shape=}"
        )
    batch, q_len, heads, head_dim = q.shape
    _, kv_len, kv_heads, _ = k.shape
    if k.shape[:3] == v.shape[:3] and k.shape[3] != v.shape[3]:
        raise NotImplementedError(
            f"the Triton kernels need v's head_dim == k's, got {k.shape=} and {v.shape=}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape=} and {v.shape=}")
    if head_dim > 256:
        raise NotImplementedError(f"the Triton kernels take head_dim <= 256, got {head_dim=}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k must be [B, S, K, H] matching q; got {q.shape=} and {k.shape=}")
    if heads % kv_heads != 0:
        raise ValueError(f"{heads=} of q must be a multiple of {kv_heads=} of k and v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32):
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got dtype {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate=}")
    if dropout_rate > 0.0 and dropout_seed is None:
        raise ValueError(f"dropout_seed is required when {dropout_rate=} > 0")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap=}")
    window = _window(sliding_window)
    if config is not None and not isinstance(config, FlashConfig):
        raise TypeError(f"config must be a FlashConfig or None, got {config!r}")
    if bwd_config is not None and not isinstance(bwd_config, FlashConfig):
        raise TypeError(f"bwd_config must be a FlashConfig or None, got {bwd_config!r}")
    if bwd_config is not None and bwd_config.gluon:
        raise ValueError(f"bwd_config.gluon: the Gluon build is a forward only, got {bwd_config!r}")

    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.ndim != 4 or bias.shape[0] not in (1, batch) or bias.shape[1] not in (1, heads):
            raise ValueError(
                f"bias must be broadcastable from [1|{batch}, 1|{heads}, {q_len}, {kv_len}], "
                f"got shape {bias.shape}"
            )
        if bias.shape[2:] != (q_len, kv_len):
            bias = jnp.broadcast_to(bias, (*bias.shape[:2], q_len, kv_len))
    if softmax_sinks is not None:
        softmax_sinks = jnp.asarray(softmax_sinks)
        if softmax_sinks.shape != (heads,):
            raise ValueError(f"softmax_sinks must have shape [{heads}], got {softmax_sinks.shape}")

    seg = None
    if segment_ids is not None:
        if isinstance(segment_ids, tuple | list):
            q_ids, kv_ids = (jnp.asarray(x, jnp.int32) for x in segment_ids)
        else:
            if q_len != kv_len:
                raise ValueError(
                    f"a single segment_ids array needs q_len == kv_len, got {q_len=}, {kv_len=}"
                )
            q_ids = kv_ids = jnp.asarray(segment_ids, jnp.int32)
        if q_ids.shape != (batch, q_len):
            raise ValueError(f"q segment_ids must be [{batch}, {q_len}], got shape {q_ids.shape}")
        if kv_ids.shape != (batch, kv_len):
            raise ValueError(
                f"kv segment_ids must be [{batch}, {kv_len}], got shape {kv_ids.shape}"
            )
        seg = (q_ids, kv_ids)

    cu = None
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_k was given without cu_seqlens_q")
        if batch != 1:
            raise ValueError(f"packed input (cu_seqlens) needs batch 1, got {batch=}")
        cu_q = jnp.asarray(cu_seqlens_q, jnp.int32)
        cu_k = cu_q if cu_seqlens_k is None else jnp.asarray(cu_seqlens_k, jnp.int32)
        if cu_q.ndim != 1 or cu_q.shape[0] < 2 or cu_k.shape != cu_q.shape:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must be [num_seqs + 1] of the same shape, "
                f"got {cu_q.shape} and {cu_k.shape}"
            )
        cu = (cu_q, cu_k)

    st = _Static(
        scale=float(head_dim**-0.5 if softmax_scale is None else softmax_scale),
        causal=bool(causal),
        window=window,
        soft_cap=0.0 if logits_soft_cap is None else float(logits_soft_cap),
        dropout_rate=float(dropout_rate),
        has_seg=seg is not None,
        varlen=cu is not None,
        fwd_cfg=config or FlashConfig(),  # both replaced below when None
        bwd_cfg=bwd_config or FlashConfig(),
    )
    ws = offer_warp_specialize(st.ws_masks(), bias, kv_len, head_dim)
    side_inputs = st.side_inputs(bias)
    if config is None:
        fwd = fwd_heuristic(head_dim, q.dtype.itemsize, side_inputs, warp_specialize=ws)
        st = dataclasses.replace(st, fwd_cfg=fwd)
    if bwd_config is None:
        group = heads // kv_heads
        bwd = bwd_heuristic(head_dim, q.dtype.itemsize, side_inputs, group, warp_specialize=ws)
        st = dataclasses.replace(st, bwd_cfg=bwd)
    seed = _seed_array(dropout_seed if dropout_rate > 0.0 else None)
    tb = _tables(st, q_len, kv_len, seg, cu, seed)
    out, lse = _attention(st, q, k, v, bias, softmax_sinks, tb)
    return (out, lse) if return_lse else out
