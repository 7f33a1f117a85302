"""The attention backends, one object each, and the fall-through between them.

`BACKENDS` holds one object per backend (``xla``, ``triton``, ``pallas``, ``cudnn``; the parts
every backend has are in `_backend`): its dense entry point (`flash_attention`: this object's
``supported``, ``invocations``, ``run``), its paged one (``paged``: `_paged_backends`), its
flex one (``flex``: `flex._xla`, `flex._triton`, `flex._pallas`), how
context-parallel steps run on it (``context_steps``, `context_reason`), its block-sparse one
(`block_sparse`), how `dot_product_attention` runs on it (``dot_product``) and its config
types; where it has none of them, ``absent`` says why. `flash_attention`,
`dot_product_attention`, `paged_attention`, `flex_attention`, `blocksparse_attention` and the
context-parallel calls all look their backend up here. `run_first` tries backends in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

import ejk_kernels_gpu
import ejk_kernels_tpu
from ejk_executor import Invocation
from ejk_kernels_gpu.flex import FlexConfig
from ejk_sequtils import (
    AttentionRequest,
    PagedAttentionRequest,
    cu_seqlens_to_segment_ids,
    reference_attention,
)

from ._backend import (
    Backend,
    Refusing,
    installed,
    is_gpu,
    kernel_executor,
    one_config,
    platform_of,
    triton_missing,
)
from ._paged_backends import PagedPallasBackend, PagedTritonBackend, PagedXlaBackend
from ._xla import xla_attention
from .flex._pallas import PallasFlexBackend
from .flex._triton import TritonFlexBackend
from .flex._xla import XlaFlexBackend

__all__ = [
    "BACKENDS",
    "IMPLEMENTATIONS",
    "Backend",
    "default_order",
    "flex_backends",
    "flex_order",
    "installed",
    "kernel_executor",
    "paged_backends",
    "platform_of",
    "resolve_implementation",
    "run_first",
    "triton_missing",
]


class XlaBackend(Backend):
    """The definition in plain jnp with its own VJP (`_xla`): every feature, every platform;
    paged (`_paged_xla`), context-parallel steps in einsums, block-sparse masks applied
    densely, `dot_product_attention` as jax.nn's own xla path."""

    name = "xla"
    paged = PagedXlaBackend()
    flex = XlaFlexBackend()
    context_steps = "einsums"
    dot_product = "jax.nn"

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        del config, bwd_config  # no performance knobs
        return xla_attention(request)

    def block_sparse(self, mask: Any) -> Backend:
        return XlaMaskBackend(mask)


class XlaMaskBackend(Backend):
    """The xla backend under a block-sparse mask: the reference with the mask as part of
    the visibility (not an additive -inf bias, so the soft cap, which maps -inf to -cap,
    cannot unmask anything)."""

    name = "xla"

    def __init__(self, mask: Any):
        self.mask = mask

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        del config, bwd_config
        dense = jnp.asarray(self.mask.dense())
        dense = dense[None, None] if dense.ndim == 2 else dense[None]  # [1, 1|N, T, S]
        kw = request.keyword_arguments()
        return reference_attention(request.q, request.k, request.v, mask=dense.astype(bool), **kw)


_CUDNN_UNSUPPORTED = {
    "logits_soft_cap": "a logits soft cap",
    "softmax_sinks": "softmax sinks",
    "segment_ids": "segment ids",
    "cu_seqlens": "packed cu_seqlens input",
    "dropout": "ejk's counter-hash dropout",
    "return_lse": "a float32 lse output",
    # jax.nn gives emptied rows the average of every value; flash attention gives 0,
    # so a bias (which may hold -inf) is served only by ejk's kernels and the reference.
    "bias": "flash_attention's bias semantics (a -inf row gives zeros)",
}


class CudnnBackend(Backend):
    """``jax.nn.dot_product_attention(implementation="cudnn")`` where the request fits it."""

    name = "cudnn"
    dot_product = "jax.nn"
    absent = MappingProxyType({
        "paged": "cuDNN serves no paged KV cache here",
        "flex": "cuDNN (through jax.nn) takes no mask_mod or score_mod",
        "context_steps": "context parallelism runs its steps on triton or xla",
        "block_sparse": "cuDNN takes no block-sparse mask",
    })  # fmt: skip

    def supported(self, request: AttentionRequest, platform: str) -> str | None:
        if not is_gpu(platform):
            return f"cuDNN needs an NVIDIA GPU, this call runs on {platform}"
        if request.q.dtype not in (jnp.float16, jnp.bfloat16):
            return f"cuDNN flash attention needs float16/bfloat16 inputs, got {request.q.dtype}"
        for feature in sorted(request.features()):
            if feature in _CUDNN_UNSUPPORTED:
                return f"jax.nn.dot_product_attention(implementation='cudnn') has no {_CUDNN_UNSUPPORTED[feature]}"
        window = request.sliding_window
        if window is not None and window[1] != 0 and not request.causal:
            return (
                f"cuDNN supports a sliding window with right size 0 only (or causal), got {window}"
            )
        b, t, s, *_, head_dim = request.shape
        if head_dim % 8 != 0 or head_dim > 256:
            return f"cuDNN needs head_dim a multiple of 8 and <= 256, got {head_dim}"
        if min(b, t, s) == 0:
            return f"cuDNN needs non-empty axes, got B={b} T={t} S={s}"
        if window is not None and t - window[0] > s:
            # Query rows past S + left see no key: jax.nn (cuDNN) averages every value
            # there, flash attention gives zeros.
            return f"rows past S + left see no key (T={t}, S={s}, window={window}): cuDNN would average them"
        return None

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        del config, bwd_config
        try:
            return jax.nn.dot_product_attention(
                request.q,
                request.k,
                request.v,
                scale=request.softmax_scale,
                is_causal=request.causal,
                local_window_size=request.sliding_window,
                implementation="cudnn",
            )
        except (ValueError, NotImplementedError, RuntimeError) as err:
            # jax raises these when cuDNN (or its version) cannot take the shape.
            raise NotImplementedError(f"cuDNN refused the request: {err}") from err


class TritonBackend(Backend):
    """``ejk_kernels_gpu`` (on CPU its kernels run in Triton's interpreter): the flash
    kernels, the split-KV paged kernel, the flex kernels with the mods translated in
    (`flex._triton`), the context-parallel block kernels (`ejk_kernels_gpu.context`);
    `dot_product_attention` through flash attention."""

    name = "triton"
    paged = PagedTritonBackend()
    context_steps = "kernels"
    dot_product = "flash"
    config_types = (
        ejk_kernels_gpu.FlashConfig,
        ejk_kernels_gpu.FlashBackwardConfig,
        ejk_kernels_gpu.PagedConfig,
        FlexConfig,
    )
    absent = MappingProxyType({"block_sparse": "the Triton kernels take no block-sparse mask"})

    def __init__(self) -> None:
        # The flex part runs ejk's own masks on this backend's built-in kernels.
        self.flex = TritonFlexBackend(builtin=self)

    def supported(self, request: AttentionRequest, platform: str) -> str | None:
        del platform  # off GPU the kernels run in Triton's interpreter
        return triton_missing() or ejk_kernels_gpu.unsupported_reason(request)

    def context_reason(self, request: AttentionRequest) -> str | None:
        """Why the context-parallel block kernels cannot serve ``request``, or None."""
        return self.supported(request, jax.default_backend())

    def invocations(self, request: AttentionRequest) -> dict[str, Any]:
        q, k, v, bias = request.q, request.k, request.v, request.bias
        kw = request.keyword_arguments()
        # The backward kernel times the gradient of a d_out shaped like the output (q's
        # shape: the kernels need v's head_dim == q's); q stands in for it in the key.
        forward = Invocation.make(ejk_kernels_gpu.FlashAttentionForward(), (q, k, v, bias), kw)
        backward = Invocation.make(ejk_kernels_gpu.FlashAttentionBackward(), (q, k, v, q, bias), kw)
        if ejk_kernels_gpu.routes_to_decode(request):
            # Decoding runs the split-KV kernel, which picks its own tile; a flash forward
            # config would force the flash forward (half the bandwidth: docs/performance.md).
            return {"backward": backward}
        return {"forward": forward, "backward": backward}

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        return ejk_kernels_gpu.attention(request, config=config, bwd_config=bwd_config)


def packed_segment_ids(request: AttentionRequest) -> Any:
    """``cu_seqlens`` as ``(q_ids, kv_ids)`` ``[1, T]``/``[1, S]`` (sequence index, -1 padding).

    With one cu_seqlens for q and k, causal and window on global positions equal
    them on positions local to each sequence, so the kernels need no offsets.
    """
    _, q_len, kv_len, *_ = request.shape
    q_ids = cu_seqlens_to_segment_ids(request.cu_seqlens_q, q_len)
    kv_ids = cu_seqlens_to_segment_ids(request.cu_seqlens_k, kv_len)
    return q_ids[None].astype(jnp.int32), kv_ids[None].astype(jnp.int32)


class PallasBackend(Backend):
    """``ejk_kernels_tpu``'s block-sparse kernel under a mask (TPU; its interpreter elsewhere).

    ``mask=None``: the mask that ``causal`` and ``sliding_window`` describe (the facade's
    `flash_attention`); `blocksparse_attention` passes its own. The kernel's config holds
    the forward and the backward block sizes, so both parts are one config.
    """

    name = "pallas"
    paged = PagedPallasBackend()
    flex = PallasFlexBackend()
    dot_product = "flash"
    config_types = (ejk_kernels_tpu.BlockSparseConfig, ejk_kernels_tpu.RaggedPagedConfig)
    absent = MappingProxyType(
        {"context_steps": "context parallelism runs its steps on triton or xla"}
    )

    def __init__(self, mask: Any = None):
        self.mask = mask

    def block_sparse(self, mask: Any) -> Backend:
        return PallasBackend(mask)

    def supported(self, request: AttentionRequest, platform: str) -> str | None:
        del platform  # off TPU the kernel runs in Pallas' interpreter
        if "cu_seqlens" in request.features():
            if "segment_ids" in request.features():
                return "the Pallas kernel takes cu_seqlens or segment_ids, not both"
            local = request.causal or request.sliding_window is not None
            if local and request.cu_seqlens_k is not request.cu_seqlens_q:
                return "causal/window over packed input with cu_seqlens_k != cu_seqlens_q needs local positions"
        return ejk_kernels_tpu.unsupported_reason(self._kernel_request(request))

    def _mask(self, request: AttentionRequest) -> Any:
        """The mask that selects the kernel's config: ours, else the one causal and window
        make (the kernel folds them into ``mask=None`` the same way)."""
        _, q_len, kv_len, *_ = request.shape
        if self.mask is not None or q_len == 0 or kv_len == 0:
            return self.mask
        return ejk_kernels_tpu.attention_mask(
            q_len, kv_len, causal=request.causal, sliding_window=request.sliding_window
        )

    def _kernel_request(self, request: AttentionRequest) -> AttentionRequest:
        """``request`` as the kernel takes it: packed sequences as segment ids."""
        if request.cu_seqlens_q is None:
            return request
        return dataclasses.replace(
            request,
            segment_ids=packed_segment_ids(request),
            cu_seqlens_q=None,
            cu_seqlens_k=None,
        )

    def invocations(self, request: AttentionRequest) -> dict[str, Any]:
        local = dataclasses.replace(
            self._kernel_request(request), causal=False, sliding_window=None
        )
        kw = {
            "mask": self._mask(request),
            "segment_ids": local.segment_ids,
            "softmax_scale": local.softmax_scale,
            "logits_soft_cap": local.logits_soft_cap,
            "softmax_sinks": local.softmax_sinks,
            "dropout_rate": local.dropout_rate,
            "dropout_seed": local.dropout_seed,
            "return_lse": local.return_lse,
        }
        inv = Invocation.make(
            ejk_kernels_tpu.BlockSparseAttention(), (local.q, local.k, local.v), kw
        )
        return {"forward": inv, "backward": inv}

    def choose_configs(
        self, request: AttentionRequest, config: Any = None, bwd_config: Any = None
    ) -> tuple[Any, Any]:
        chosen = super().choose_configs(request, one_config(config, bwd_config))
        return chosen[0], chosen[0]

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        del bwd_config  # the same config (see choose_configs)
        return ejk_kernels_tpu.blocksparse_attention_request(
            self._kernel_request(request), self.mask, config=config
        )


BACKENDS: dict[str, Backend] = {
    "xla": XlaBackend(),
    "triton": TritonBackend(),
    "pallas": PallasBackend(),
    "cudnn": CudnnBackend(),
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(BACKENDS)


def paged_backends() -> dict[str, Backend]:
    """The paged parts of the backends that have one, by name (read when called: a test or
    a user replacing one is seen)."""
    return {name: b.paged for name, b in BACKENDS.items() if b.paged is not None}


def flex_backends() -> dict[str, Backend]:
    """The flex part of every backend, by name; a backend without one refuses each call with
    its ``absent`` reason (read when called: a test or a user replacing one is seen)."""
    return {
        name: b.flex if b.flex is not None else Refusing(name, b.absent["flex"])
        for name, b in BACKENDS.items()
    }


def flex_order(platform: str) -> tuple[str, ...]:
    """What `flex_attention`'s ``implementation=None`` tries on ``platform``: `default_order`'s
    backends that have a flex part."""
    return tuple(n for n in default_order(platform) if BACKENDS[n].flex is not None)


def default_order(platform: str) -> tuple[str, ...]:
    """What ``implementation=None`` tries, in order, on ``platform``."""
    if is_gpu(platform):
        return ("triton", "cudnn", "xla")
    if platform == "tpu":
        return ("pallas", "xla")
    return ("xla",)


def resolve_implementation(
    implementation: Any, names: Sequence[str] = IMPLEMENTATIONS
) -> tuple[str, ...] | None:
    """``implementation=`` as a tuple of backend names, or None for the platform default."""
    if implementation is None:
        return None
    given = (implementation,) if isinstance(implementation, str) else implementation
    if not isinstance(given, Sequence) or isinstance(given, str | bytes):
        raise TypeError(
            f"implementation must be None, a name or a sequence of names, got {implementation!r}"
        )
    if len(given) == 0:
        raise ValueError("implementation must not be an empty sequence")
    for name in given:
        if not isinstance(name, str):
            raise TypeError(f"implementation names must be strings, got {name!r}")
        if name not in names:
            raise ValueError(f"implementation must be one of {tuple(names)}, got {name!r}")
    return tuple(given)


def run_first(
    request: AttentionRequest | PagedAttentionRequest,
    names: Sequence[str],
    config: Any = None,
    bwd_config: Any = None,
    backends: dict[str, Backend] | None = None,
) -> tuple[str, Any]:
    """Run the first backend in ``names`` that serves ``request``; ``(name, result)``.

    ``backends`` maps names to backends (default: flash attention's `BACKENDS`; paged
    attention passes its own, which take a `PagedAttentionRequest`).

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
            else backend.supported(request, platform)
        )
        if backend is not None and reason is None:
            try:
                return name, backend.run_configured(request, config, bwd_config)
            except NotImplementedError as err:
                reason = str(err)
        reasons.append(f"{name}: {reason}")
    if len(names) == 1:
        raise NotImplementedError(
            f"implementation={names[0]!r} cannot serve this request: {reasons[0]}"
        )
    raise NotImplementedError("no implementation could serve this request; " + "; ".join(reasons))
