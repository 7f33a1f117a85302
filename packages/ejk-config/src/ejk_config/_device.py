"""What the kernels run on: platform family, dispatch platform, a cache fingerprint.

Everything here reads jax's device objects in process; nothing starts a
subprocess (no ``nvidia-smi``), so it is cheap enough for a hot path, and the
default-device answers are memoised after the first call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["abstractify", "device_fingerprint", "device_kind", "get_device_platform"]

_FAMILY = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
_DISPATCH = {"gpu": "triton", "tpu": "pallas", "cpu": "xla"}


def _device(dev: Any | None) -> Any:
    if dev is None:
        return jax.devices()[0]
    if not isinstance(dev, jax.Device):
        raise TypeError(f"dev must be a jax.Device or None, got {type(dev).__name__}")
    return dev


def device_kind(dev: jax.Device | None = None) -> str:
    """The platform family of ``dev`` (default: jax's first device): "gpu", "tpu", "cpu"
    or "unknown"."""
    return _FAMILY.get(_device(dev).platform, "unknown")


def get_device_platform(dev: jax.Device | None = None) -> str:
    """The kernel platform to dispatch to on ``dev``: "triton" on GPUs, "pallas" on TPUs,
    "xla" elsewhere. A kernel's ``run_<platform>`` method is picked by this name."""
    return _DISPATCH.get(device_kind(dev), "xla")


def _platform_version(dev: Any) -> str:
    client = getattr(dev, "client", None)
    version = getattr(client, "platform_version", "") if client is not None else ""
    return " ".join(str(version).split())


@functools.cache
def _fingerprint(devices: tuple[Any, ...]) -> str:
    first = devices[0]
    kinds = sorted({d.device_kind for d in devices})
    return "|".join(
        [
            first.platform,
            ",".join(kinds),
            _platform_version(first),
            f"n={len(devices)}",
        ]
    )


def device_fingerprint(devices: jax.Device | Sequence[jax.Device] | None = None) -> str:
    """A string that identifies the hardware a config was chosen for.

    It joins the platform, the device kind (e.g. ``NVIDIA H100 80GB HBM3``),
    the platform version reported by the runtime (CUDA/driver or libtpu
    version) and the device count, so a config tuned on one machine is never
    reused on a different one.

    Args:
        devices: a device or a sequence of devices; default: all devices of jax's
            default backend.
    """
    if devices is None:
        devices = tuple(jax.devices())
    elif isinstance(devices, jax.Device):
        devices = (devices,)
    else:
        devices = tuple(devices)
        if not devices or not all(isinstance(d, jax.Device) for d in devices):
            raise TypeError(f"devices must be jax Devices, got {devices!r}")
    return _fingerprint(devices)


def _abstract_leaf(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or isinstance(x, int | float | complex):
        return x
    sharding = None
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        sharding = x.sharding
        if type(sharding).__name__ == "SingleDeviceSharding":
            sharding = None
    weak_type = bool(getattr(getattr(x, "aval", None), "weak_type", False))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak_type)


def abstractify(pytree: Any) -> Any:
    """Replace every array leaf (jax or NumPy array, tracer) with a ``jax.ShapeDtypeStruct``.

    Shape, dtype and weak type are kept, and so is the sharding of a concrete
    array placed over several devices; values are dropped. Non-array leaves
    (Python numbers, strings, None) are returned unchanged.
    """
    return jax.tree_util.tree_map(_abstract_leaf, pytree)
