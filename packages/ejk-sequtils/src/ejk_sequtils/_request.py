"""Validation of an attention call: one `AttentionRequest` that every backend receives.

Every check raises ``ValueError`` (a wrong value or shape) or ``TypeError`` (a wrong
kind of object or dtype) whose message names the argument and shows the offending
value, so a user can fix the call without reading the source. The request holds the
same arguments in one normal form (window as a pair, segment ids as a
``(q_ids, kv_ids)`` pair, sinks folded to ``[N]``, the scale resolved). The facade
validates once; the kernel packages' own public functions validate through this same
code, and their internal entry points take the request without checking it again.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import check_non_decreasing, describe_value
from ._reference import fold_sinks
from ._visibility import normalize_window, split_segment_ids

__all__ = ["AttentionRequest", "validate_attention"]

# As NumPy dtypes: comparing a dtype with jnp's scalar types runs Python code (eager calls pay it).
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


@dataclasses.dataclass(frozen=True)
class AttentionRequest:
    """A validated attention call in normal form (what a backend receives).

    Arrays are kept as given (jax arrays, tracers or NumPy arrays); ``softmax_sinks`` is
    ``[N]`` (several sinks per head already folded, differentiably), ``segment_ids`` a
    ``(q_ids [B, T], kv_ids [B, S])`` pair, ``cu_seqlens_k`` set whenever
    ``cu_seqlens_q`` is, ``sliding_window`` a ``(left, right)`` pair.
    """

    q: Any
    k: Any
    v: Any
    bias: Any
    softmax_scale: float
    causal: bool
    sliding_window: tuple[int, int] | None
    logits_soft_cap: float | None
    softmax_sinks: Any
    segment_ids: tuple[Any, Any] | None
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    dropout_rate: float
    dropout_seed: Any
    return_lse: bool
    # The global (batch, head, row, column) of this call's first element in the dropout
    # hash, set by a sharded call for each shard (None: 0s); see `dropout_key`.
    dropout_offsets: tuple[Any, Any, Any, Any] | None = None

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(B, T, S, N, K, H)``."""
        b, t, n, h = self.q.shape
        return b, t, self.k.shape[1], n, self.k.shape[2], h

    def keyword_arguments(self) -> dict[str, Any]:
        """The keyword arguments of `reference_attention` (and of the kernels' public functions)."""
        return {
            "softmax_scale": self.softmax_scale,
            "causal": self.causal,
            "sliding_window": self.sliding_window,
            "logits_soft_cap": self.logits_soft_cap,
            "softmax_sinks": self.softmax_sinks,
            "segment_ids": self.segment_ids,
            "cu_seqlens_q": self.cu_seqlens_q,
            "cu_seqlens_k": self.cu_seqlens_k,
            "dropout_rate": self.dropout_rate,
            "dropout_seed": self.dropout_seed,
            "return_lse": self.return_lse,
        }

    def features(self) -> frozenset[str]:
        """Names of the optional features this request uses (for capability checks)."""
        used = {
            "bias": self.bias is not None,
            "causal": self.causal,
            "sliding_window": self.sliding_window is not None,
            "logits_soft_cap": self.logits_soft_cap is not None,
            "softmax_sinks": self.softmax_sinks is not None,
            "segment_ids": self.segment_ids is not None,
            "cu_seqlens": self.cu_seqlens_q is not None,
            "dropout": self.dropout_rate > 0.0,
            "return_lse": self.return_lse,
        }
        return frozenset(name for name, on in used.items() if on)


def _array(x: Any, name: str, what: str) -> Any:
    """``x`` as something with ``.shape`` and ``.dtype`` (jax arrays and tracers kept as they are)."""
    if isinstance(x, jax.Array | np.ndarray):
        return x
    if isinstance(x, np.generic):
        return np.asarray(x)
    raise TypeError(f"{name} must be {what}, got {describe_value(x)}")


def _float_array(x: Any, name: str) -> Any:
    x = _array(x, name, "a floating jax or NumPy array")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype, got {name}.dtype={x.dtype}")
    return x


def _int_array(x: Any, name: str) -> Any:
    x = _array(x, name, "an integer jax or NumPy array")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must have an integer dtype, got {name}.dtype={x.dtype}")
    return x


def _concrete(x: Any) -> np.ndarray | None:
    """The value of ``x`` if it is known now (not a tracer), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _real(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {describe_value(x)}")
    return float(x)


def _flag(x: Any, name: str) -> bool:
    if not isinstance(x, bool | np.bool_):
        raise TypeError(f"{name} must be a bool, got {describe_value(x)}")
    return bool(x)


def _softmax_scale(softmax_scale: Any, head_dim: int) -> float:
    """``softmax_scale`` as a finite float > 0; None gives ``head_dim ** -0.5``."""
    if softmax_scale is None:
        return head_dim**-0.5 if head_dim > 0 else 1.0
    scale = _real(softmax_scale, "softmax_scale")
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    return scale


def _soft_cap(logits_soft_cap: Any) -> float | None:
    """``logits_soft_cap`` as None or a finite float > 0."""
    if logits_soft_cap is None:
        return None
    cap = _real(logits_soft_cap, "logits_soft_cap")
    if not math.isfinite(cap) or cap <= 0.0:
        raise ValueError(f"logits_soft_cap must be a finite number > 0, got {logits_soft_cap!r}")
    return cap


def _validate_cu_seqlens(cu: Any, name: str, length: int) -> Any:
    cu = _int_array(cu, name)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(
            f"{name} must be rank 1 [num_seqs + 1] with >= 2 entries, got {name}.shape={cu.shape}"
        )
    value = _concrete(cu)
    if value is not None:
        if value[0] != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0]={int(value[0])}")
        check_non_decreasing(value, name)
        if value[-1] > length:
            raise ValueError(
                f"{name} ends at {int(value[-1])}, past the {length} packed tokens of its input"
            )
    return cu


def _validate_segment_ids(segment_ids: Any, batch: int, q_len: int, kv_len: int) -> tuple:
    pair = isinstance(segment_ids, tuple | list)
    q_ids, kv_ids = split_segment_ids(segment_ids)
    names = ("segment_ids[0]", "segment_ids[1]") if pair else ("segment_ids", "segment_ids")
    q_ids = _int_array(q_ids, names[0])
    kv_ids = _int_array(kv_ids, names[1])
    if not pair and q_len != kv_len:
        raise ValueError(
            f"segment_ids of shape {q_ids.shape} is for self attention (T == S), but "
            f"q_len={q_len} != kv_len={kv_len}: pass a (q_ids, kv_ids) pair"
        )
    for ids, length, name in ((q_ids, q_len, names[0]), (kv_ids, kv_len, names[1])):
        if ids.shape != (batch, length):
            raise ValueError(f"{name} must have shape {(batch, length)}, got {ids.shape}")
    return q_ids, kv_ids


def _validate_sinks(softmax_sinks: Any, heads: int) -> Any:
    sinks = _float_array(softmax_sinks, "softmax_sinks")
    if sinks.ndim not in (1, 2) or sinks.shape[0] != heads:
        raise ValueError(
            f"softmax_sinks must have shape [N]=({heads},) or [N, num_sinks]=({heads}, num_sinks), "
            f"got softmax_sinks.shape={sinks.shape}"
        )
    return fold_sinks(sinks)


def _validate_seed(dropout_seed: Any, dropout_rate: Any) -> Any:
    """The seed as an int or an int32/uint32 scalar; a PRNG key (``jax.random.key``, as
    ejKernel's ``dropout_rng``) gives the uint32 ``jax.random.bits`` draws from it."""
    if dropout_seed is None:
        raise ValueError(f"dropout_seed is required when dropout_rate={dropout_rate!r} > 0")
    expected = "an int, an int32/uint32 scalar array or a jax.random.key"
    if isinstance(dropout_seed, bool):
        raise TypeError(f"dropout_seed must be {expected}, got {describe_value(dropout_seed)}")
    if isinstance(dropout_seed, numbers.Integral):
        return int(dropout_seed)
    if isinstance(dropout_seed, jax.Array) and jax.dtypes.issubdtype(
        dropout_seed.dtype, jax.dtypes.prng_key
    ):
        if dropout_seed.shape != ():
            raise ValueError(
                f"dropout_seed must be a single PRNG key, got dropout_seed.shape={dropout_seed.shape}"
            )
        return jax.random.bits(dropout_seed, dtype=jnp.uint32)
    seed = _array(dropout_seed, "dropout_seed", expected)
    if seed.shape != () or seed.dtype not in (jnp.int32, jnp.uint32):
        raise TypeError(
            f"dropout_seed must be {expected}, got dropout_seed.shape={seed.shape} "
            f"dropout_seed.dtype={seed.dtype}"
        )
    return seed


def validate_attention(
    q: Any,
    k: Any,
    v: Any,
    bias: Any = None,
    *,
    softmax_scale: Any = None,
    causal: Any = False,
    sliding_window: Any = None,
    logits_soft_cap: Any = None,
    softmax_sinks: Any = None,
    segment_ids: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    dropout_rate: Any = 0.0,
    dropout_seed: Any = None,
    return_lse: Any = False,
) -> AttentionRequest:
    """Check every argument of an attention call (`reference_attention`'s) and return them
    in normal form.

    Empty axes are valid (B, T or S = 0); packed input (``cu_seqlens_q``) needs B = 1 and
    may be combined with segment ids (a token then sees keys of its own sequence *and*
    segment).

    Raises:
        TypeError: an argument of the wrong kind or dtype (the message names it).
        ValueError: an argument of the wrong shape or value (the message names it).
    """
    q = _float_array(q, "q")
    k = _float_array(k, "k")
    v = _float_array(v, "v")
    for x, name, layout in (
        (q, "q", "[B, T, N, H]"),
        (k, "k", "[B, S, K, H]"),
        (v, "v", "[B, S, K, Hv]"),
    ):
        if x.ndim != 4:
            raise ValueError(f"{name} must be rank 4 {layout}, got {name}.shape={x.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one dtype (no promotion: cast them first), got "
            f"q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}"
        )
    batch, q_len, heads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k must have q's batch size {batch}, got k.shape={k.shape}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k must have q's head_dim {head_dim}, got k.shape={k.shape}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must match k in [B, S, K], got v.shape={v.shape}, k.shape={k.shape}")
    kv_len, kv_heads = k.shape[1], k.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q heads={heads} must be a multiple of k/v heads={kv_heads}")

    if bias is not None:
        bias = _float_array(bias, "bias")
        ok = (
            bias.ndim == 4
            and bias.shape[0] in (1, batch)
            and bias.shape[1] in (1, heads)
            and bias.shape[2:] == (q_len, kv_len)
        )
        if not ok:
            raise ValueError(
                f"bias must have shape [1|{batch}, 1|{heads}, {q_len}, {kv_len}], "
                f"got bias.shape={bias.shape}"
            )

    scale = _softmax_scale(softmax_scale, head_dim)
    causal = _flag(causal, "causal")
    window = normalize_window(sliding_window)
    logits_soft_cap = _soft_cap(logits_soft_cap)

    if softmax_sinks is not None:
        softmax_sinks = _validate_sinks(softmax_sinks, heads)

    if segment_ids is not None:
        segment_ids = _validate_segment_ids(segment_ids, batch, q_len, kv_len)

    if cu_seqlens_k is not None and cu_seqlens_q is None:
        raise ValueError("cu_seqlens_k was given without cu_seqlens_q")
    if cu_seqlens_q is not None:
        if batch != 1:
            raise ValueError(f"packed input (cu_seqlens_q) needs batch 1, got q.shape={q.shape}")
        cu_seqlens_q = _validate_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q_len)
        if cu_seqlens_k is None:
            if q_len != kv_len:
                raise ValueError(f"cu_seqlens_k is needed when q_len={q_len} != kv_len={kv_len}")
            cu_seqlens_k = cu_seqlens_q
        else:
            cu_seqlens_k = _validate_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", kv_len)
        if cu_seqlens_k.shape != cu_seqlens_q.shape:
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same shape, got "
                f"{cu_seqlens_q.shape} and {cu_seqlens_k.shape}"
            )

    rate = _real(dropout_rate, "dropout_rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate!r}")
    seed = _validate_seed(dropout_seed, dropout_rate) if rate > 0.0 else None

    return AttentionRequest(
        q=q,
        k=k,
        v=v,
        bias=bias,
        softmax_scale=scale,
        causal=causal,
        sliding_window=window,
        logits_soft_cap=logits_soft_cap,
        softmax_sinks=softmax_sinks,
        segment_ids=segment_ids,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        dropout_rate=rate,
        dropout_seed=seed,
        return_lse=_flag(return_lse, "return_lse"),
    )
