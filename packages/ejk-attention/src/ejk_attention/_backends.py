"""The attention backends the facade chooses from, and the fall-through between them.

Every backend is one object with the same parts:

- ``supported(request, platform)``: None, or the reason it cannot serve the request
  (a cheap static check);
- ``invocations(request)``: the `ejk_executor` invocations whose configs it runs with,
  ``{"forward": ..., "backward": ...}`` (none for backends without performance knobs);
  the executor chooses them (explicit, overlay, memory, persistent cache where ``ejk
  tune`` stores, then heuristic or autotune), ``heuristic_config``/``backward_config``
  /``config_space`` are the kernels' own answers for the same invocations;
- ``run(request, config, bwd_config)``: computes the request; it may still raise
  ``NotImplementedError`` with a reason (a kernel refusing a shape it only learns about
  when called), and the facade then moves on to the next backend. Any other error is
  a bug and propagates.

Kernel packages are imported inside the methods, never at import time, so the facade
works with whichever of them is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ejk_sequtils import AttentionRequest, PagedAttentionRequest

from ._xla import xla_attention

__all__ = [
    "BACKENDS",
    "IMPLEMENTATIONS",
    "Backend",
    "default_order",
    "installed",
    "kernel_executor",
    "platform_of",
    "resolve_implementation",
    "run_first",
    "triton_missing",
]

# Why the triton backends refuse a call where Triton is not installed: it comes with the
# cuda extra only, so a CPU install stays light (its interpreter alone needs triton too).
TRITON_MISSING = (
    "Triton is not installed: the triton backend needs the cuda extra "
    "(pip install 'ejk-attention[cuda]'; on CPU, triton alone runs its interpreter)"
)


def installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported here (looked up, not imported)."""
    return importlib.util.find_spec(module) is not None


def triton_missing() -> str | None:
    """`TRITON_MISSING` where Triton is not installed, else None."""
    return None if installed("triton") else TRITON_MISSING


def platform_of(request: AttentionRequest | PagedAttentionRequest) -> str:
    """The platform the call runs on: the devices of concrete inputs, else the default backend."""
    q = request.q
    if isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer):
        return next(iter(q.devices())).platform
    return jax.default_backend()


def _is_gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda", "rocm")


@functools.cache
def kernel_executor() -> Any:
    """The executor that picks kernel configs: explicit, memory, then the persistent cache
    (where ``ejk tune`` stores autotuned ones), else the kernel's heuristic."""
    from ejk_executor import ConfigSelectorChain, Executor

    from ._tuned import open_cache

    return Executor(ConfigSelectorChain(persistent=open_cache()))


class Backend:
    """One way to compute attention (the base is a backend without performance knobs)."""

    name: str = ""

    def supported(self, request: AttentionRequest, platform: str) -> str | None:
        """None if this backend serves ``request`` on ``platform``, else the reason."""
        del request, platform
        return None

    def invocations(self, request: AttentionRequest) -> dict[str, Any]:
        """The executor invocations (``"forward"``, ``"backward"``) whose configs ``run`` takes."""
        del request
        return {}

    def heuristic_config(self, request: AttentionRequest) -> Any:
        """The forward config the kernel's heuristic picks (None: no knobs)."""
        inv = self.invocations(request).get("forward")
        return None if inv is None else inv.kernel.heuristic_cfg(inv)

    def backward_config(self, request: AttentionRequest) -> Any:
        """The backward config the kernel's heuristic picks (None: no knobs)."""
        inv = self.invocations(request).get("backward")
        return None if inv is None else inv.kernel.heuristic_cfg(inv)

    def config_space(self, request: AttentionRequest) -> list[Any]:
        """The forward configs worth timing for ``request``."""
        inv = self.invocations(request).get("forward")
        return [] if inv is None else list(inv.kernel.config_space(inv))

    def choose_configs(
        self, request: AttentionRequest, config: Any = None, bwd_config: Any = None
    ) -> tuple[Any, Any]:
        """``(config, bwd_config)``: the given ones, else the executor's choice for each."""
        invocations = self.invocations(request)
        chosen = []
        for part, given in (("forward", config), ("backward", bwd_config)):
            inv = invocations.get(part)
            if given is None and inv is not None:
                given = kernel_executor().chooser.choose(inv).cfg
            chosen.append(given)
        return chosen[0], chosen[1]

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.run")

    def run_configured(
        self,
        request: AttentionRequest | PagedAttentionRequest,
        config: Any = None,
        bwd_config: Any = None,
    ) -> Any:
        """``run`` with `choose_configs`' configs. A config the executor read from its
        persistent cache that fails at launch is dropped there (one CacheWarning) and the
        call runs again with the executor's next choice."""
        configs = self.choose_configs(request, config, bwd_config)
        try:
            return self.run(request, *configs)
        except NotImplementedError:
            raise
        except Exception as err:
            reason = f"it failed at launch ({type(err).__name__}: {err})"
            invocations = self.invocations(request)
            chain = kernel_executor().chooser
            dropped = [
                chain.drop_cached(invocations[part], chosen, reason)
                for part, given, chosen in zip(
                    ("forward", "backward"), (config, bwd_config), configs, strict=True
                )
                if given is None and part in invocations
            ]
            if not any(dropped):
                raise
        return self.run(request, *self.choose_configs(request, config, bwd_config))


class XlaBackend(Backend):
    """The definition in plain jnp with its own VJP (`_xla`): every feature, every platform."""

    name = "xla"

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        del config, bwd_config  # no performance knobs
        return xla_attention(request)


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

    def supported(self, request: AttentionRequest, platform: str) -> str | None:
        if not _is_gpu(platform):
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
    """``ejk_kernels_gpu`` (on CPU its kernels run in Triton's interpreter)."""

    name = "triton"

    def supported(self, request: AttentionRequest, platform: str) -> str | None:
        del platform  # off GPU the kernels run in Triton's interpreter
        if triton_missing():
            return triton_missing()
        try:
            import ejk_kernels_gpu
        except ImportError as err:
            return f"ejk_kernels_gpu is not available: {err}"
        return ejk_kernels_gpu.unsupported_reason(request)

    def invocations(self, request: AttentionRequest) -> dict[str, Any]:
        from ejk_executor import Invocation
        from ejk_kernels_gpu import FlashAttentionBackward, FlashAttentionForward, routes_to_decode

        q, k, v, bias = request.q, request.k, request.v, request.bias
        kw = request.keyword_arguments()
        # The backward kernel times the gradient of a d_out shaped like the output (q's
        # shape: the kernels need v's head_dim == q's); q stands in for it in the key.
        forward = Invocation.make(FlashAttentionForward(), (q, k, v, bias), kw)
        backward = Invocation.make(FlashAttentionBackward(), (q, k, v, q, bias), kw)
        if routes_to_decode(request):
            # Decoding runs the split-KV kernel, which picks its own tile; a flash forward
            # config would force the flash forward (half the bandwidth: docs/performance.md).
            return {"backward": backward}
        return {"forward": forward, "backward": backward}

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        import ejk_kernels_gpu

        return ejk_kernels_gpu.attention(request, config=config, bwd_config=bwd_config)


def packed_segment_ids(request: AttentionRequest) -> Any:
    """``cu_seqlens`` as ``(q_ids, kv_ids)`` ``[1, T]``/``[1, S]`` (sequence index, -1 padding).

    With one cu_seqlens for q and k, causal and window on global positions equal
    them on positions local to each sequence, so the kernels need no offsets.
    """
    from ejk_sequtils import cu_seqlens_to_segment_ids

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

    def __init__(self, mask: Any = None):
        self.mask = mask

    def _module(self) -> Any:
        import ejk_kernels_tpu

        return ejk_kernels_tpu

    def supported(self, request: AttentionRequest, platform: str) -> str | None:
        del platform  # off TPU the kernel runs in Pallas' interpreter
        try:
            module = self._module()
        except ImportError as err:
            return f"ejk_kernels_tpu is not available: {err}"
        if "cu_seqlens" in request.features():
            if "segment_ids" in request.features():
                return "the Pallas kernel takes cu_seqlens or segment_ids, not both"
            local = request.causal or request.sliding_window is not None
            if local and request.cu_seqlens_k is not request.cu_seqlens_q:
                return "causal/window over packed input with cu_seqlens_k != cu_seqlens_q needs local positions"
        return module.unsupported_reason(self._kernel_request(request))

    def _mask(self, request: AttentionRequest) -> Any:
        """The mask that selects the kernel's config: ours, else the one causal and window
        make (the kernel folds them into ``mask=None`` the same way)."""
        _, q_len, kv_len, *_ = request.shape
        if self.mask is not None or q_len == 0 or kv_len == 0:
            return self.mask
        return self._module().attention_mask(
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
        from ejk_executor import Invocation
        from ejk_kernels_tpu import BlockSparseAttention

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
        inv = Invocation.make(BlockSparseAttention(), (local.q, local.k, local.v), kw)
        return {"forward": inv, "backward": inv}

    def choose_configs(
        self, request: AttentionRequest, config: Any = None, bwd_config: Any = None
    ) -> tuple[Any, Any]:
        if bwd_config is not None and config is not None and bwd_config != config:
            raise ValueError(
                "the Pallas kernel's config holds the forward and backward block sizes: "
                f"pass one config, got config={config!r} and bwd_config={bwd_config!r}"
            )
        chosen = super().choose_configs(request, config or bwd_config)
        return chosen[0], chosen[0]

    def run(self, request: AttentionRequest, config: Any, bwd_config: Any) -> Any:
        del bwd_config  # the same config (see choose_configs)
        return self._module().blocksparse_attention_request(
            self._kernel_request(request), self.mask, config=config
        )


BACKENDS: dict[str, Backend] = {
    "xla": XlaBackend(),
    "triton": TritonBackend(),
    "pallas": PallasBackend(),
    "cudnn": CudnnBackend(),
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(BACKENDS)


def default_order(platform: str) -> tuple[str, ...]:
    """What ``implementation=None`` tries, in order, on ``platform``."""
    if _is_gpu(platform):
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
