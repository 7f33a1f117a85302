"""`flash_attention`: one attention call over every ejk backend."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import ArrayLike, Bool, Float, Int, Integer

from ejk_sequtils import AttentionRequest, cu_seqlens_valid, poison_unless, validate_attention

from ._backends import (
    BACKENDS,
    IMPLEMENTATIONS,
    default_order,
    platform_of,
    resolve_implementation,
    run_first,
)
from ._bias import hiding_bias
from ._eager import on_one_default_device, run_compiled
from ._sharding import inferred_mesh, sharded_call
from ._tuned import drop_tuned_backend, tuned_backend

__all__ = ["flash_attention"]

AnyArray = Array | np.ndarray
SegmentIds = Int[AnyArray, "B T"] | tuple[Int[AnyArray, "B T"], Int[AnyArray, "B S"]]


def _compute(
    request: AttentionRequest, names: tuple[str, ...] | None, config: Any, bwd_config: Any
) -> Any:
    if names is not None:
        return run_first(request, names, config, bwd_config)[1]
    names = default_order(platform_of(request))
    tuned = tuned_backend(request)  # what `ejk tune` measured fastest here, if anything
    if tuned is not None and tuned in IMPLEMENTATIONS:
        try:
            return run_first(request, (tuned,), config, bwd_config)[1]
        except NotImplementedError:
            pass  # it does not serve this call: the platform's order
        except (
            Exception
        ) as err:  # a stored choice must never fail the call it was meant to speed up
            drop_tuned_backend(request, f"{tuned} failed ({type(err).__name__}: {err})")
    return run_first(request, names, config, bwd_config)[1]


def flash_attention(
    q: Float[AnyArray, "B T N H"],
    k: Float[AnyArray, "B S K H"],
    v: Float[AnyArray, "B S K Hv"],
    bias: Float[AnyArray, "#B #N T S"] | None = None,
    *,
    attention_mask: Bool[AnyArray, "#B #N T S"] | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    sliding_window: int | tuple[int, int] | None = None,
    logits_soft_cap: float | None = None,
    softmax_sinks: Float[AnyArray, " N *num_sinks"] | None = None,
    segment_ids: SegmentIds | None = None,
    cu_seqlens_q: Int[AnyArray, " L"] | None = None,
    cu_seqlens_k: Int[AnyArray, " L"] | None = None,
    dropout_rate: float = 0.0,
    dropout_seed: int | Integer[ArrayLike, ""] | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
    config: Any = None,
    bwd_config: Any = None,
    mesh: Mesh | None = None,
    in_specs: PartitionSpec | None = None,
    out_specs: PartitionSpec | None = None,
) -> Float[Array, "B T N Hv"] | tuple[Float[Array, "B T N Hv"], Float[Array, "B N T"]]:
    """Multi-head attention on the best backend available, with the reference's semantics.

    Every backend computes what `reference_attention` defines (see its docstring for
    the masking rules); they differ only in speed and in which features they serve.

    Args:
        q: queries ``[B, T, N, H]``.
        k: keys ``[B, S, K, H]`` with ``N % K == 0``; query head n reads kv head ``n // (N // K)``.
        v: values ``[B, S, K, Hv]``, same dtype as q and k: no promotion (unlike jnp's
            arithmetic), mixed dtypes raise TypeError, and NumPy arrays keep their dtype
            (float64 included); cast first. `dot_product_attention` follows jax.nn instead.
        bias: additive logits bias ``[1|B, 1|N, T, S]``.
        attention_mask: boolean ``[1|B, 1|N, T, S]``, True where a query may see a key
            (ejKernel's spelling): the same as a ``-inf`` bias on the hidden keys, so a row
            it empties gives zeros. Not with ``logits_soft_cap`` (the cap would turn a
            hidden key's ``-inf`` into ``-cap``): pass such masks as segment ids or a window.
        softmax_scale: multiplies ``q·kᵀ``; default ``H ** -0.5``.
        causal: query i sees keys ``j <= i`` (top-left aligned).
        sliding_window: ``(left, right)`` or ``w`` for ``(w, w)``: keys in ``[i - left, i + right]``.
        logits_soft_cap: ``cap * tanh(logits / cap)``.
        softmax_sinks: ``[N]`` one logit per query head, or ``[N, num_sinks]``, in the softmax
            denominator only (several fold to one by logsumexp).
        segment_ids: ``[B, T]`` (self attention) or ``(q_ids [B, T], kv_ids [B, S])``;
            tokens attend within equal ids >= 0; negative ids are padding.
        cu_seqlens_q: ``[num_seqs + 1]`` offsets of packed query sequences (B == 1): they
            start at 0, never decrease and end at or before T. Concrete offsets that do
            not are refused (ValueError); traced ones (under jit) cannot be read, so
            invalid ones make the output, the lse and the gradients NaN
            (`ejk_sequtils.cu_seqlens_valid` is the check).
        cu_seqlens_k: offsets of packed key sequences, the same rules against S; default
            ``cu_seqlens_q``.
        dropout_rate: probability of dropping an attention weight (ejk's counter-hash mask).
        dropout_seed: an int or int32/uint32 scalar; required when ``dropout_rate > 0``.
        return_lse: also return the float32 log-sum-exp ``[B, N, T]``.
        implementation: None (the backend ``ejk tune`` stored for this shape, then the
            platform's order: triton, cuDNN, xla on GPU; pallas, xla on TPU; xla on CPU), one of ``"xla"``, ``"triton"``, ``"pallas"``, ``"cudnn"``, or
            a sequence of them tried in order.
        config: the forward kernel config (block sizes etc.) for triton/pallas; default: the
            executor's choice (a config ``ejk tune`` stored, else the kernel's heuristic).
            xla and cuDNN have none.
        bwd_config: the backward kernel config, chosen the same way (triton: an
            ``ejk_kernels_gpu.FlashBackwardConfig``; a ``FlashConfig`` there is deprecated,
            converted with a DeprecationWarning; pallas: one config holds both, so pass
            ``config`` alone).
        mesh: run sharded over this mesh (the facade writes the shard_map).
            Without it, a q that already carries a batch/head NamedSharding (concrete, or
            under jit on an Explicit mesh) is run per shard the same way.
        in_specs: PartitionSpec over q's ``[B, T, N, H]`` axes (k and v follow); B, N and
            T may be sharded. Sharding T runs context parallelism (`ring_attention`: the ring
            or all-gather strategy, causal self-attention in the zigzag layout (with segment
            ids: the contiguous split where it balances the work, decided when the call
            runs), masks on global positions; packed input given as ``cu_seqlens_q`` alone
            runs as its segment ids; dropout draws the unsharded call's mask; its steps run
            on the first of ``"triton"`` and ``"xla"`` that ``implementation`` names and
            that serves the call, another backend alone is refused); a bias, or packing
            with its own ``cu_seqlens_k``, is refused there with the reason.
            Default: batch over every mesh axis.
        out_specs: the output's spec; must equal q's (default).

    Returns:
        ``out [B, T, N, Hv]`` in q's dtype, or ``(out, lse [B, N, T] float32)`` with ``return_lse``.

    Raises:
        ValueError, TypeError: a bad argument (the message names it).
        NotImplementedError: no requested implementation can serve the call (each reason given).
    """
    if attention_mask is not None:
        bias = _masked_bias(q, k, bias, attention_mask, logits_soft_cap)
    plain = segment_ids is None and cu_seqlens_q is None and cu_seqlens_k is None
    plain = plain and dropout_seed is None and mesh is None and in_specs is None
    if (
        plain
        and out_specs is None
        and _concrete_on_one_default_device(q, k, v, bias, softmax_sinks)
    ):
        # The common eager call: jit's own dispatch (C++) keys the compiled function, and
        # validation runs while tracing (nothing here depends on concrete values).
        options = _PlainOptions(
            softmax_scale, causal, sliding_window, logits_soft_cap, dropout_rate, return_lse
        )
        statics = (options, implementation, config, bwd_config, tuple(BACKENDS.values()))
        if _hashable(statics):
            return _compiled_plain(q, k, v, bias, softmax_sinks, *statics)
    request = validate_attention(
        q,
        k,
        v,
        bias,
        softmax_scale=softmax_scale,
        causal=causal,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        segment_ids=segment_ids,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        dropout_rate=dropout_rate,
        dropout_seed=dropout_seed,
        return_lse=return_lse,
    )
    names = resolve_implementation(implementation)
    if mesh is None:
        if in_specs is not None or out_specs is not None:
            raise ValueError("in_specs/out_specs need mesh=")
        inferred = inferred_mesh(request)
        if inferred is not None:
            # q is already batch/head sharded: run each shard's attention where it lives, so
            # kernels (custom calls XLA cannot partition) are not gathered onto every device.
            mesh, in_specs = inferred
    # Concrete arrays: one compiled function per signature instead of op-by-op dispatch.
    result = run_compiled(_dispatch, request, names, config, bwd_config, mesh, in_specs, out_specs)
    return _poisoned_if_invalid(request, result)


def _poisoned_if_invalid(request: AttentionRequest, result: Any) -> Any:
    """``result`` with every value NaN when traced ``cu_seqlens`` are invalid offsets.

    Concrete offsets were checked by `validate_attention` (a ValueError); traced ones
    (under jit) cannot be read while tracing, and a backend given decreasing offsets would
    return plausible numbers. One scalar check and a multiply by 1 or NaN instead.
    """
    offsets = [
        (cu, n)
        for cu, n in (
            (request.cu_seqlens_q, request.q.shape[1]),
            (request.cu_seqlens_k, request.k.shape[1]),
        )
        if isinstance(cu, jax.core.Tracer)
    ]
    if not offsets:
        return result
    valid = functools.reduce(jnp.logical_and, [cu_seqlens_valid(cu, n) for cu, n in offsets])
    if isinstance(result, tuple):
        return poison_unless(valid, *result)
    return poison_unless(valid, result)[0]


def _masked_bias(q: Any, k: Any, bias: Any, attention_mask: Any, logits_soft_cap: Any) -> Any:
    """``bias`` with ``-inf`` where ``attention_mask`` is False (checked first)."""
    if logits_soft_cap is not None:
        raise NotImplementedError(
            "attention_mask with logits_soft_cap: the cap maps a hidden key's -inf logit to "
            f"-cap (logits_soft_cap={logits_soft_cap!r}); give the mask as segment_ids, "
            "causal or sliding_window instead"
        )
    batch, q_len, heads = np.shape(q)[:3] if np.ndim(q) == 4 else (None, None, None)
    kv_len = np.shape(k)[1] if np.ndim(k) == 4 else None
    if batch is None or kv_len is None or (bias is not None and np.ndim(bias) != 4):
        return bias  # validate_attention names the bad q, k or bias
    mask = jnp.asarray(attention_mask)  # a jax array (or tracer) comes back as it is
    ok = mask.ndim == 4 and mask.shape[0] in (1, batch) and mask.shape[1] in (1, heads)
    if not ok or mask.shape[2:] != (q_len, kv_len):
        raise ValueError(
            f"attention_mask must have shape [1|{batch}, 1|{heads}, {q_len}, {kv_len}], "
            f"got attention_mask.shape={mask.shape}"
        )
    if mask.dtype != jnp.bool_:
        raise TypeError(f"attention_mask must be boolean, got attention_mask.dtype={mask.dtype}")
    return hiding_bias(bias, mask, q_len, kv_len)


def _dispatch(
    request: AttentionRequest,
    names: tuple[str, ...] | None,
    config: Any,
    bwd_config: Any,
    mesh: Any,
    in_specs: PartitionSpec | None,
    out_specs: PartitionSpec | None,
) -> Any:
    """``request`` on the first backend of ``names`` that serves it, per shard of ``mesh``."""

    def run_local(local: AttentionRequest) -> Any:
        return _compute(local, names, config, bwd_config)

    if mesh is None:
        return run_local(request)
    return sharded_call(
        run_local,
        request,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        implementation=names,
    )


class _PlainOptions(NamedTuple):
    """The static options of a call without segment ids, packing, a seed or a mesh."""

    softmax_scale: Any
    causal: Any
    sliding_window: Any
    logits_soft_cap: Any
    dropout_rate: Any
    return_lse: Any


def _plain(
    q: Any,
    k: Any,
    v: Any,
    bias: Any,
    softmax_sinks: Any,
    options: _PlainOptions,
    implementation: Any,
    config: Any,
    bwd_config: Any,
    backends: tuple[Any, ...],
) -> Any:
    """A call without segment ids, packing, a seed or a mesh: validated, then the backends
    in order (`_compute`), as the general path runs it on one device.

    ``backends`` is only a cache key: the backend objects the dispatch looks up (a test or a
    user replacing one gets a new trace).
    """
    del backends
    request = validate_attention(
        q, k, v, bias, softmax_sinks=softmax_sinks, **options._asdict()
    )  # fmt: skip
    return _compute(request, resolve_implementation(implementation), config, bwd_config)


# One compiled `_plain` per signature of concrete arrays on one device: the statics
# positional, so jit's C++ dispatch keys it as cheaply as a user's own jitted call.
_compiled_plain = jax.jit(_plain, static_argnums=(5, 6, 7, 8, 9))


def _concrete_on_one_default_device(*arrays: Any) -> bool:
    """Every array given is a concrete jax array, q's on one device of the default platform."""
    for x in arrays:
        if x is not None and (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)):
            return False
    # a sharded q may run per shard (inferred_mesh): the general path
    return on_one_default_device(arrays[0].sharding)


def _hashable(values: tuple[Any, ...]) -> bool:
    try:
        hash(values)
    except TypeError:
        return False
    return True
