"""Frozen msgspec carriers for kernel performance knobs (block sizes, warps, stages).

They hold performance knobs only: anything that changes numerics (causal,
window, scale, soft cap) is a kernel argument, never a config field, so tuning
cannot change results. Every field is optional: ``None`` means "let the kernel
or the autotuner choose".
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

__all__ = ["BwdParams", "FwdParams", "from_json", "to_dict", "to_json"]

T = TypeVar("T")


def _check_fields(cfg: msgspec.Struct, *, power_of_two: tuple[str, ...]) -> None:
    """Every set field must be a positive int; the named ones also a power of two."""
    for name in cfg.__struct_fields__:
        value = getattr(cfg, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{type(cfg).__name__}.{name} must be an int or None, "
                f"got {value!r} of type {type(value).__name__}"
            )
        if value <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be positive, got {name}={value}")
        if name in power_of_two and value & (value - 1):
            raise ValueError(
                f"{type(cfg).__name__}.{name} must be a power of two, got {name}={value}"
            )


class _Params(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shared behaviour of the carriers: validation and field-wise merging."""

    def __post_init__(self) -> None:
        _check_fields(self, power_of_two=("num_warps",))

    @classmethod
    def merge(cls: type[T], base: T | None, override: T | None) -> T:
        """A config whose fields come from ``override`` where set (not None), else ``base``.

        Args:
            base: the defaults; ``None`` counts as all fields unset.
            override: the values that win; ``None`` counts as all fields unset.

        Returns:
            A new config of this class.
        """
        for arg_name, arg in (("base", base), ("override", override)):
            if arg is not None and not isinstance(arg, cls):
                raise TypeError(
                    f"{cls.__name__}.merge: {arg_name} must be a {cls.__name__} or None, "
                    f"got {type(arg).__name__}"
                )
        fields: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            for source in (override, base):
                value = None if source is None else getattr(source, name)
                if value is not None:
                    fields[name] = value
                    break
        return cls(**fields)


class FwdParams(_Params, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Forward-pass performance knobs.

    Attributes:
        blocksize_m: rows of an output tile (generic matmul-style kernels).
        blocksize_k: reduction tile.
        blocksize_n: columns of an output tile.
        q_blocksize: query rows per program in attention.
        kv_blocksize: key/value rows per inner-loop step in attention.
        blocksize_heads: heads per program.
        blocksize_keys: key tile for split-key kernels.
        num_key_splits: number of key splits (flash-decoding style).
        num_warps: GPU warps per program; a power of two.
        num_stages: software-pipelining stages.
    """

    blocksize_m: int | None = None
    blocksize_k: int | None = None
    blocksize_n: int | None = None
    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    blocksize_heads: int | None = None
    blocksize_keys: int | None = None
    num_key_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


class BwdParams(_Params, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Backward-pass performance knobs (fields as in :class:`FwdParams`)."""

    blocksize_m: int | None = None
    blocksize_k: int | None = None
    blocksize_n: int | None = None
    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    @classmethod
    def from_fwd_params(cls, fwd: FwdParams, scale: float = 0.5) -> BwdParams:
        """Backward knobs derived from forward ones.

        Block sizes shared with ``fwd`` are multiplied by ``scale`` and rounded
        down (at least 1): backward kernels keep more tiles live, so they
        usually want smaller blocks. Warps and stages are copied.

        Args:
            fwd: the forward config.
            scale: block-size factor, in ``(0, 1]`` typically; must be positive.
        """
        if not isinstance(fwd, FwdParams):
            raise TypeError(f"fwd must be a FwdParams, got {type(fwd).__name__}")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ValueError(f"scale must be a positive number, got {scale=!r}")
        fields: dict[str, Any] = {}
        for name in cls.__struct_fields__:
            value = getattr(fwd, name)
            if value is None:
                continue
            if name in ("num_warps", "num_stages"):
                fields[name] = value
            else:
                fields[name] = max(1, int(value * scale))
        return cls(**fields)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The fields of a msgspec Struct (or dataclass, or dict) as a plain dict."""
    if isinstance(cfg, msgspec.Struct):
        return msgspec.structs.asdict(cfg)
    if isinstance(cfg, dict):
        return dict(cfg)
    import dataclasses

    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    raise TypeError(
        f"to_dict expects a msgspec Struct, dataclass or dict, got {type(cfg).__name__}"
    )


def to_json(cfg: Any) -> str:
    """JSON text of a config, with a deterministic key order."""
    try:
        return msgspec.json.encode(cfg, order="deterministic").decode()
    except TypeError as e:
        raise TypeError(f"to_json cannot encode {type(cfg).__name__}: {e}") from None


def from_json(text: str | bytes, type: type[T]) -> T:
    """Decode a config of class ``type`` from JSON, validating field types and values.

    Raises:
        ValueError: (a ``msgspec.ValidationError``) if the text does not describe a valid ``type``.
    """
    try:
        return msgspec.json.decode(text, type=type)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as e:
        raise ValueError(f"from_json: not valid JSON for {type.__name__}: {e}") from None
