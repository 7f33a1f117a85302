"""`Kernel`, the base class kernel packages subclass, and `Invocation`, one call's context."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import jax
import numpy as np

from ejk_config import abstractify, device_fingerprint, get_device_platform, stable_json

__all__ = ["Cfg", "Invocation", "Kernel", "Out", "default_key_builder_with_sharding", "is_dynamic"]

Cfg = TypeVar("Cfg")
Out = TypeVar("Out")


class Kernel(Generic[Cfg, Out]):
    """A JAX operation with performance knobs, run through an `Executor`.

    Subclasses set ``name`` (and ``version``, bumped whenever a change makes
    cached configs stale) and ``config_type`` (the class of their configs; the
    persistent cache uses it to decode them), and implement:

    - ``run(*args, cfg, **kwargs)``: the computation. ``run_<platform>`` (with
      ``<platform>`` one of ``"triton"``, ``"pallas"``, ``"xla"``, as
      ``ejk_config.get_device_platform`` names them) is used instead when defined
      for the platform the call runs on.
    - ``heuristic_cfg(inv)``: a good config from the shapes alone.
    - ``config_space(inv)``: the candidates the autotuner times (default: the
      heuristic one only).
    - optionally a custom backward: ``forward_with_residuals(*args, cfg, **kwargs)
      -> (out, residuals)`` and ``backward(residuals, dout, *, cfg, **kwargs) ->
      grads``, where ``grads`` holds one entry per positional argument (a
      gradient pytree shaped like that argument, or ``None`` for none). Both may
      also be given per platform (``forward_with_residuals_<platform>``,
      ``backward_<platform>``). With a custom backward, floating-point arrays
      must be passed positionally; array keyword arguments get no gradient and
      must be integer or boolean (masks, segment ids).

    Array leaves of the arguments (jax or NumPy arrays, tracers) are traced;
    everything else (Python numbers, strings, None, tuples of those) is static:
    it is part of the cache key and is passed to ``run`` as is.
    """

    name: str = ""
    version: str = "1"
    config_type: type | None = None
    # True: a config read from the persistent cache must be one of ``config_space(inv)``
    # (what the autotuner can have stored); see `cached_cfg_problem`.
    cached_cfg_in_space: bool = False

    def __init__(
        self,
        name: str | None = None,
        *,
        version: str | None = None,
        config_type: type | None = None,
    ):
        if name is not None:
            self.name = name
        if version is not None:
            self.version = version
        if config_type is not None:
            self.config_type = config_type
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a Kernel needs a non-empty str name, got name={self.name!r}")
        if not isinstance(self.version, str):
            raise TypeError(f"Kernel version must be a str, got version={self.version!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, version={self.version!r})"

    def __ejk_stable_key__(self) -> list[str]:
        return [self.name, self.version]

    def run(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        """The computation with config ``cfg``; override this or ``run_<platform>``."""
        raise NotImplementedError(f"kernel {self.name!r} defines no run method")

    def heuristic_cfg(self, inv: Invocation[Cfg, Out]) -> Cfg:
        """The config to use without tuning, from the invocation's shapes and static args."""
        raise NotImplementedError(f"kernel {self.name!r} defines no heuristic_cfg")

    def config_space(self, inv: Invocation[Cfg, Out]) -> Iterable[Cfg]:
        """The candidate configs the autotuner times (default: the heuristic config)."""
        return [self.heuristic_cfg(inv)]

    def cached_cfg_problem(self, inv: Invocation[Cfg, Out], cfg: Cfg) -> str | None:
        """None if ``cfg``, read from the persistent cache, may run ``inv``; else why not.

        A file on disk can hold any config of ``config_type``: a kernel whose configs
        can exceed what runs (tile sizes, shared memory) checks them against its own
        bounds here. Default: with ``cached_cfg_in_space`` set, only the members of
        ``config_space(inv)`` may run (a search space pruned to what fits the device is
        the kernel's bounds); else every config may.
        """
        if not self.cached_cfg_in_space or cfg in list(self.config_space(inv)):
            return None
        return f"{cfg!r} is not in its search space for this call ({self.name})"

    def compiled_apart(self, inv: Invocation[Cfg, Out]) -> Any:
        """What, beside the call key and the config, keeps the executor's compiled bodies of
        two calls apart (hashable; default None).

        A kernel may leave a static argument out of its cache key (its stable key omits it)
        because configs tuned for one value serve another; the body still computes with it,
        so two calls differing there must not share a body: return it here.
        """
        del inv
        return None

    # The methods below are used by the executor; subclasses rarely override them.

    def method(self, base: str, platform: str) -> Callable[..., Any] | None:
        """``self.<base>_<platform>`` if defined, else ``self.<base>`` if overridden, else None."""
        specific = getattr(self, f"{base}_{platform}", None)
        if specific is not None:
            return specific
        generic = getattr(type(self), base, None)
        if generic is None or generic is getattr(Kernel, base, None):
            return None
        return getattr(self, base)

    def has_custom_backward(self, platform: str) -> bool:
        """Whether both ``forward_with_residuals`` and ``backward`` exist for ``platform``."""
        fwd = self.method("forward_with_residuals", platform)
        bwd = self.method("backward", platform)
        if (fwd is None) != (bwd is None):
            missing = "backward" if bwd is None else "forward_with_residuals"
            raise TypeError(
                f"kernel {self.name!r} defines a custom backward only in part: {missing} is "
                f"missing for platform {platform!r}"
            )
        return fwd is not None


def is_dynamic(leaf: Any) -> bool:
    """Whether an argument leaf is traced (an array or tracer) rather than static."""
    if isinstance(leaf, bool | int | float | complex | str | bytes) or leaf is None:
        return False
    return isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct) or (
        hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    )


@functools.cache
def library_version() -> str:
    """The installed ejk-executor and ejk-config versions, part of every cache key."""
    parts = []
    for dist in ("ejk-executor", "ejk-config"):
        try:
            parts.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist}=?")
    return ",".join(parts)


def call_devices(leaves: Iterable[Any]) -> tuple[str, str]:
    """(platform, device fingerprint) for a call: the default backend's, unless the
    concrete arrays live on another platform, whose devices are then used."""
    default = jax.devices()[0].platform
    platform = default
    for leaf in leaves:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            platform = next(iter(leaf.sharding.device_set)).platform
            break
    devices = jax.devices() if platform == default else jax.devices(platform)
    return get_device_platform(devices[0]), device_fingerprint(devices)


def sharding_fingerprint(x: Any) -> str:
    """A stable string for the sharding of ``x`` (array, tracer or ShapeDtypeStruct).

    ``"none"`` for values placed on one device or whose sharding is not known
    (tracers); for a ``NamedSharding`` the mesh axes with their sizes and the
    partition spec; never a device id or memory address.
    """
    if not is_dynamic(x):
        raise TypeError(f"sharding_fingerprint expects an array, got {type(x).__name__}")
    try:
        sharding = getattr(x, "sharding", None)
    except Exception:  # tracers may refuse to report one
        sharding = None
    if sharding is None or type(sharding).__name__ == "SingleDeviceSharding":
        return "none"
    if isinstance(sharding, jax.sharding.Sharding) and getattr(
        sharding, "is_fully_replicated", False
    ):
        return f"replicated(n={len(sharding.device_set)})"
    return stable_json(sharding)


def default_key_builder_with_sharding(
    kernel: Kernel[Any, Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    device_fp: str | None = None,
) -> str:
    """The cache key of a call: kernel name and version, every argument's shape,
    dtype and sharding, the static arguments, the device fingerprint and the
    library version.

    Args:
        kernel: the kernel called.
        args: positional arguments (arrays, tracers, ShapeDtypeStructs or static values).
        kwargs: keyword arguments (likewise).
        device_fp: the device fingerprint; default: that of the devices the call runs on.

    Returns:
        ``"<kernel name>/<version>/<32 hex digits>"``; equal keys mean equal inputs
        in every respect but the values.
    """
    if device_fp is None:
        _, device_fp = call_devices(jax.tree_util.tree_leaves((args, kwargs)))
    arg_keys = jax.tree_util.tree_map(_leaf_key, (tuple(args), dict(kwargs)))
    material = stable_json([kernel.name, kernel.version, arg_keys, device_fp, library_version()])
    digest = hashlib.sha256(material.encode()).hexdigest()[:32]
    return f"{kernel.name}/{kernel.version}/{digest}"


def _leaf_key(leaf: Any) -> Any:
    if not is_dynamic(leaf):
        return leaf
    # One string in a 1-tuple: cheap to encode, and never equal to a static leaf
    # (tuples are pytree nodes, so no static leaf is a tuple).
    shape = ",".join(str(int(d)) for d in leaf.shape)
    return (f"{np.dtype(leaf.dtype).name}[{shape}]@{sharding_fingerprint(leaf)}",)


@dataclasses.dataclass(frozen=True, eq=False)
class Invocation(Generic[Cfg, Out]):
    """One call of a kernel: its arguments and everything its config depends on.

    Attributes:
        kernel: the kernel called.
        args: positional arguments as given (arrays, tracers or, for recorded
            invocations, ``jax.ShapeDtypeStruct``s).
        kwargs: keyword arguments as given.
        platform: the dispatch platform ("triton", "pallas" or "xla").
        device_fingerprint: the hardware the call runs on.
        call_key: the cache key (see `default_key_builder_with_sharding`).
    """

    kernel: Kernel[Cfg, Out]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    platform: str
    device_fingerprint: str
    call_key: str

    @classmethod
    def make(
        cls,
        kernel: Kernel[Cfg, Out],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        platform: str | None = None,
        device_fp: str | None = None,
    ) -> Invocation[Cfg, Out]:
        """Build the invocation of ``kernel(*args, **kwargs)``."""
        if not isinstance(kernel, Kernel):
            raise TypeError(f"kernel must be an ejk_executor.Kernel, got {type(kernel).__name__}")
        args = tuple(args)
        kwargs = dict(kwargs)
        if platform is None or device_fp is None:
            platform, device_fp = call_devices(jax.tree_util.tree_leaves((args, kwargs)))
        key = default_key_builder_with_sharding(kernel, args, kwargs, device_fp=device_fp)
        return cls(kernel, args, kwargs, platform, device_fp, key)

    @functools.cached_property
    def abstract_args(self) -> tuple[Any, ...]:
        """``args`` with every array or tracer replaced by a ``jax.ShapeDtypeStruct``."""
        return abstractify(self.args)

    @functools.cached_property
    def abstract_kwargs(self) -> dict[str, Any]:
        """``kwargs`` likewise."""
        return abstractify(dict(self.kwargs))

    def abstract(self) -> Invocation[Cfg, Out]:
        """This invocation holding only abstract values (no arrays, no tracers)."""
        return dataclasses.replace(self, args=self.abstract_args, kwargs=self.abstract_kwargs)

    @property
    def is_abstract(self) -> bool:
        """True if no argument is a concrete array or tracer."""
        leaves = jax.tree_util.tree_leaves((self.args, self.kwargs))
        return not any(is_dynamic(x) and not isinstance(x, jax.ShapeDtypeStruct) for x in leaves)

    def __repr__(self) -> str:
        return f"Invocation({self.call_key}, platform={self.platform!r})"
