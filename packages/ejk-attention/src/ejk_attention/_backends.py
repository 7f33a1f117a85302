"""The attention backends the facade chooses from, and the fall-through between them.

A backend is a name, a ``refuse`` predicate that says why it cannot serve a
request (or None when it can), and ``run``, which may still raise
``NotImplementedError`` with a reason (a kernel refusing a shape it only learns
about when called). Kernel packages are imported inside ``run``, never at
import time, so the facade works with whichever of them is installed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ejk_sequtils import AttentionRequest, reference_attention

__all__ = [
    "BACKENDS",
    "IMPLEMENTATIONS",
    "Backend",
    "default_order",
    "kernel_executor",
    "platform_of",
    "resolve_implementation",
    "run_blocksparse_kernel",
    "run_first",
    "triton_through",
]


@dataclasses.dataclass(frozen=True)
class Backend:
    """One way to compute attention.

    Attributes:
        name: the ``implementation=`` string that selects it.
        refuse: ``(request, platform) -> reason or None``; a cheap static check.
        run: ``(request, config) -> out | (out, lse)``; may raise NotImplementedError.
    """

    name: str
    refuse: Callable[[AttentionRequest, str], str | None]
    run: Callable[[AttentionRequest, Any], Any]


def platform_of(request: AttentionRequest) -> str:
    """The platform the call runs on: the devices of concrete inputs, else the default backend."""
    q = request.q
    if isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer):
        return next(iter(q.devices())).platform
    return jax.default_backend()


def _is_gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda", "rocm")


# xla: the reference, every feature, every platform.


def _xla_refuse(request: AttentionRequest, platform: str) -> str | None:
    del request, platform
    return None


def _xla_run(request: AttentionRequest, config: Any) -> Any:
    del config  # the reference has no performance knobs
    return reference_attention(
        request.q, request.k, request.v, request.bias, **request.keyword_arguments()
    )


# cudnn: jax.nn.dot_product_attention(implementation="cudnn") where the request fits it.

_CUDNN_UNSUPPORTED = {
    "logits_soft_cap": "a logits soft cap",
    "softmax_sinks": "softmax sinks",
    "segment_ids": "segment ids",
    "cu_seqlens": "packed cu_seqlens input",
    "dropout": "ejk's counter-hash dropout",
    "return_lse": "a float32 lse output",
}


def _cudnn_refuse(request: AttentionRequest, platform: str) -> str | None:
    if not _is_gpu(platform):
        return f"cuDNN needs an NVIDIA GPU, this call runs on {platform}"
    if request.q.dtype not in (jnp.float16, jnp.bfloat16):
        return f"cuDNN flash attention needs float16/bfloat16 inputs, got {request.q.dtype}"
    for feature in sorted(request.features()):
        if feature in _CUDNN_UNSUPPORTED:
            return f"jax.nn.dot_product_attention(implementation='cudnn') has no {_CUDNN_UNSUPPORTED[feature]}"
    window = request.sliding_window
    if window is not None and window[1] != 0 and not request.causal:
        return f"cuDNN supports a sliding window with right size 0 only (or causal), got {window}"
    head_dim = request.q.shape[-1]
    if head_dim % 8 != 0 or head_dim > 256:
        return f"cuDNN needs head_dim a multiple of 8 and <= 256, got {head_dim}"
    return None


def _cudnn_run(request: AttentionRequest, config: Any) -> Any:
    del config
    bias = None if request.bias is None else request.bias.astype(request.q.dtype)
    try:
        return jax.nn.dot_product_attention(
            request.q,
            request.k,
            request.v,
            bias,
            scale=request.softmax_scale,
            is_causal=request.causal,
            local_window_size=request.sliding_window,
            implementation="cudnn",
        )
    except (ValueError, NotImplementedError, RuntimeError) as err:
        # jax raises these when cuDNN (or its version) cannot take the shape.
        raise NotImplementedError(f"cuDNN refused the request: {err}") from err


# triton: ejk_kernels_gpu.flash_attention (on CPU it runs through Triton's interpreter).


def _triton_refuse(request: AttentionRequest, platform: str) -> str | None:
    del platform  # off GPU the kernels run in Triton's interpreter
    if request.v.shape[-1] != request.q.shape[-1]:
        return f"the Triton kernel needs v's head_dim {request.v.shape[-1]} == q's {request.q.shape[-1]}"
    return None  # the kernel checks its own limits and raises NotImplementedError


@functools.cache
def kernel_executor() -> Any:
    """The executor that picks kernel configs: explicit, memory, then the persistent cache
    (where ``ejk tune`` stores autotuned ones), else the kernel's heuristic."""
    from ejk_executor import ConfigSelectorChain, Executor

    from ._tuned import open_cache

    return Executor(ConfigSelectorChain(persistent=open_cache()))


def triton_through(executor: Any, request: AttentionRequest, kernel_class: Any) -> Any:
    """The Triton forward under ``executor``'s config choice (``ejk tune`` uses the same
    call, so the cache keys it writes are the ones the facade reads)."""
    return executor(
        kernel_class(), request.q, request.k, request.v, request.bias, **request.keyword_arguments()
    )


def _triton_run(request: AttentionRequest, config: Any) -> Any:
    try:
        from ejk_kernels_gpu import FlashAttentionForward
        from ejk_kernels_gpu import flash_attention as kernel
    except ImportError as err:
        raise NotImplementedError(
            f"ejk_kernels_gpu.flash_attention is not available: {err}"
        ) from None
    if config is None:  # the forward config through the executor's selection chain
        return triton_through(kernel_executor(), request, FlashAttentionForward)
    return kernel(
        request.q, request.k, request.v, request.bias, **request.keyword_arguments(), config=config
    )


# pallas: ejk_kernels_tpu.blocksparse_attention with the mask causal/window describe
# (TPU; Pallas' TPU interpreter elsewhere).


def _pallas_refuse(request: AttentionRequest, platform: str) -> str | None:
    del platform  # off TPU the kernel runs in Pallas' interpreter
    features = request.features()
    if "bias" in features:
        return "the block-sparse Pallas kernel has no logits bias"
    if request.v.shape[-1] != request.q.shape[-1]:
        return f"the Pallas kernel needs v's head_dim {request.v.shape[-1]} == q's {request.q.shape[-1]}"
    if "cu_seqlens" in features:
        if "segment_ids" in features:
            return "the Pallas kernel takes cu_seqlens or segment_ids, not both"
        local = request.causal or request.sliding_window is not None
        if local and request.cu_seqlens_k is not request.cu_seqlens_q:
            return "causal/window over packed input with cu_seqlens_k != cu_seqlens_q needs local positions"
    return None


def _packed_segment_ids(request: AttentionRequest) -> Any:
    """``cu_seqlens`` as ``(q_ids, kv_ids)`` ``[1, T]``/``[1, S]`` (sequence index, -1 padding).

    With one cu_seqlens for q and k, causal and window on global positions equal
    them on positions local to each sequence, so the kernels need no offsets.
    """
    from ejk_sequtils import cu_seqlens_to_segment_ids

    _, q_len, kv_len, *_ = request.shape
    q_ids = cu_seqlens_to_segment_ids(request.cu_seqlens_q, q_len)
    kv_ids = cu_seqlens_to_segment_ids(request.cu_seqlens_k, kv_len)
    return q_ids[None].astype(jnp.int32), kv_ids[None].astype(jnp.int32)


def _kernels_tpu() -> Any:
    """The `ejk_kernels_tpu` module (NotImplementedError, with the reason, where it fails to import)."""
    try:
        import ejk_kernels_tpu
    except ImportError as err:
        raise NotImplementedError(f"ejk_kernels_tpu is not available: {err}") from None
    return ejk_kernels_tpu


def run_blocksparse_kernel(
    request: AttentionRequest, mask: Any, segment_ids: Any, config: Any
) -> Any:
    """``ejk_kernels_tpu.blocksparse_attention`` on ``request`` under ``mask``.

    Dropout passes through: the kernels draw the reference's keep mask
    (`ejk_attention.dropout_keep_mask`) from the same global (batch, head, row, column).
    """
    return _kernels_tpu().blocksparse_attention(
        request.q,
        request.k,
        request.v,
        mask,
        segment_ids=segment_ids,
        softmax_scale=request.softmax_scale,
        logits_soft_cap=request.logits_soft_cap,
        softmax_sinks=request.softmax_sinks,
        dropout_rate=request.dropout_rate,
        dropout_seed=request.dropout_seed,
        return_lse=request.return_lse,
        config=config,
    )


def _pallas_run(request: AttentionRequest, config: Any) -> Any:
    _, q_len, kv_len, *_ = request.shape
    segment_ids = request.segment_ids
    if request.cu_seqlens_q is not None:
        segment_ids = _packed_segment_ids(request)
    mask = _kernels_tpu().attention_mask(
        q_len, kv_len, causal=request.causal, sliding_window=request.sliding_window
    )
    return run_blocksparse_kernel(request, mask, segment_ids, config)


BACKENDS: dict[str, Backend] = {
    "xla": Backend("xla", _xla_refuse, _xla_run),
    "triton": Backend("triton", _triton_refuse, _triton_run),
    "pallas": Backend("pallas", _pallas_refuse, _pallas_run),
    "cudnn": Backend("cudnn", _cudnn_refuse, _cudnn_run),
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(BACKENDS)


def default_order(platform: str) -> tuple[str, ...]:
    """What ``implementation=None`` tries, in order, on ``platform``."""
    if _is_gpu(platform):
        return ("triton", "cudnn", "xla")
    if platform == "tpu":
        return ("pallas", "xla")
    return ("xla",)


def resolve_implementation(implementation: Any) -> tuple[str, ...] | None:
    """``implementation=`` as a tuple of backend names, or None for the platform default."""
    if implementation is None:
        return None
    names = (implementation,) if isinstance(implementation, str) else implementation
    if not isinstance(names, Sequence) or isinstance(names, str | bytes):
        raise TypeError(
            f"implementation must be None, a name or a sequence of names, got {implementation!r}"
        )
    if len(names) == 0:
        raise ValueError("implementation must not be an empty sequence")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"implementation names must be strings, got {name!r}")
        if name not in BACKENDS:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {name!r}")
    return tuple(names)


def run_first(
    request: AttentionRequest,
    names: Sequence[str],
    config: Any,
    backends: dict[str, Backend] | None = None,
) -> tuple[str, Any]:
    """Run the first backend in ``names`` that serves ``request``; ``(name, result)``.

    ``backends`` maps names to backends (default: flash attention's `BACKENDS`).

    Raises:
        NotImplementedError: none could, with each backend's reason.
    """
    backends = BACKENDS if backends is None else backends
    platform = platform_of(request)
    reasons = []
    for name in names:
        backend = backends.get(name)
        reason = (
            f"this operation runs on {', '.join(backends)} only"
            if backend is None
            else backend.refuse(request, platform)
        )
        if backend is not None and reason is None:
            try:
                return name, backend.run(request, config)
            except NotImplementedError as err:
                reason = str(err)
        reasons.append(f"{name}: {reason}")
    if len(names) == 1:
        raise NotImplementedError(
            f"implementation={names[0]!r} cannot serve this request: {reasons[0]}"
        )
    raise NotImplementedError("no implementation could serve this request; " + "; ".join(reasons))
