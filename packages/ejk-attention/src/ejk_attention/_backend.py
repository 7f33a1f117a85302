"""What a backend is: `Backend`, its parts (supported, configs, run), and what the backends
share (the executor that picks kernel configs, the platform of a call, whether Triton is
installed). The backends themselves, one object each, are in `_backends`.

A backend's parts:

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
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax

from ejk_executor import ConfigSelectorChain, Executor
from ejk_sequtils import AttentionRequest, PagedAttentionRequest

from ._tuned import open_cache

__all__ = [
    "TRITON_MISSING",
    "Backend",
    "Refusing",
    "installed",
    "is_gpu",
    "kernel_executor",
    "one_config",
    "platform_of",
    "triton_missing",
]

# Why the triton backends refuse a call where Triton is not installed: it comes with the
# cuda extra only, so a CPU install stays light (its interpreter alone needs triton too).
TRITON_MISSING = (
    "Triton is not installed: the triton backend needs the cuda extra "
    "(pip install 'ejk-attention[cuda]'; on CPU, triton alone runs its interpreter)"
)


def installed(distribution: str) -> bool:
    """Whether ``distribution`` is installed here (looked up, not imported: Triton must not
    be imported before the GPU kernels choose its interpreter or not)."""
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def triton_missing() -> str | None:
    """`TRITON_MISSING` where Triton is not installed, else None."""
    return None if installed("triton") else TRITON_MISSING


def platform_of(request: AttentionRequest | PagedAttentionRequest) -> str:
    """The platform the call runs on: the devices of concrete inputs, else the default backend."""
    q = request.q
    if isinstance(q, jax.Array) and not isinstance(q, jax.core.Tracer):
        return next(iter(q.devices())).platform
    return jax.default_backend()


def is_gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda", "rocm")


def one_config(config: Any, bwd_config: Any) -> Any:
    """The one config of a kernel whose config holds the forward and backward block sizes
    (the Pallas kernels): ``config`` or ``bwd_config``.

    Raises:
        ValueError: both given, and different.
    """
    if bwd_config is not None and config is not None and bwd_config != config:
        raise ValueError(
            "the Pallas kernel's config holds the forward and backward block sizes: "
            f"pass one config, got config={config!r} and bwd_config={bwd_config!r}"
        )
    return config or bwd_config


@functools.cache
def kernel_executor() -> Any:
    """The executor that picks kernel configs: explicit, memory, then the persistent cache
    (where ``ejk tune`` stores autotuned ones), else the kernel's heuristic."""
    return Executor(ConfigSelectorChain(persistent=open_cache()))


class Backend:
    """One way to compute attention (the base is a backend without performance knobs).

    A facade backend (`_backends.BACKENDS`) is one object for every entry point: this
    object's parts serve `flash_attention` (dense), and its attributes hold the others,
    None where it has none (``absent`` says why): ``paged`` (a backend taking a
    `PagedAttentionRequest`), ``flex`` (a backend taking a `flex.FlexRequest`: `flex_attention`),
    ``context_steps`` (how context-parallel steps run on it:
    ``"kernels"`` or ``"einsums"``), `block_sparse` (a backend for an `ejk_kernels_tpu`
    mask), ``dot_product`` (how `dot_product_attention` runs on it: ``"jax.nn"`` itself, or
    ``"flash"``, flash attention then jax.nn's emptied rows) and ``config_types``.
    """

    name: str = ""
    paged: Backend | None = None
    flex: Backend | None = None
    context_steps: str | None = None
    dot_product: str | None = None
    config_types: tuple[type, ...] = ()
    absent: Mapping[str, str] = MappingProxyType({})

    def block_sparse(self, mask: Any) -> Backend | None:
        """The backend that runs attention under the block-sparse ``mask``, or None."""
        del mask
        return None

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


class Refusing(Backend):
    """A backend name an entry point knows where that backend has no part for it (``absent``
    says why): it refuses every call with that reason, so ``implementation=`` naming it
    says why rather than that the name is unknown."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason

    def supported(self, request: Any, platform: str) -> str | None:
        del request, platform
        return self.reason
