"""Eager calls through ``jax.jit``: a call on concrete arrays runs one compiled function.

Outside a trace, JAX runs a function op by op (each op a dispatch, the reference's
dozens of them take milliseconds on a tiny shape). `run_compiled` instead traces the
dispatch once per *signature* (the request's static options, which of its arrays are
given and which are the same array, the shapes and dtypes jit sees, and the caller's
static arguments) and reuses the compiled function. Everything the dispatch decides
(the tuned backend, the executor's configs, the fall-through between backends) is
decided while tracing, as it is under a user's ``jit``.

`eager_jit` does the same for a function of arrays and keyword options
(`dot_product_attention`, `paged_attention`, `ragged_paged_attention`): jit's own
dispatch keys the compiled function by the arrays' shapes and the static options.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from ejk_sequtils import AttentionRequest

from ._backends import BACKENDS, platform_of

__all__ = ["eager_jit", "run_compiled"]

# The request's fields that hold arrays (traced); every other field is a static option.
_ARRAY_FIELDS = (
    "q",
    "k",
    "v",
    "bias",
    "softmax_sinks",
    "segment_ids",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "dropout_seed",
)
_STATIC_FIELDS = tuple(
    f.name for f in dataclasses.fields(AttentionRequest) if f.name not in _ARRAY_FIELDS
)


class _Signature(NamedTuple):
    """What one compiled function is for (jit adds the arrays' shapes, dtypes, shardings)."""

    fn: Callable[..., Any]
    static_fields: tuple[Any, ...]  # the request's fields in _STATIC_FIELDS order
    treedef: Any  # which array fields are given (None or not, a segment-id pair)
    aliases: tuple[int, ...]  # leaf i is unique array aliases[i] (cu_seqlens_k is cu_seqlens_q)
    extra: tuple[Any, ...]  # fn's arguments after the request
    backends: tuple[Any, ...]  # the backend objects the dispatch may look up while tracing


def run_compiled(fn: Callable[..., Any], request: AttentionRequest, *extra: Any) -> Any:
    """``fn(request, *extra)``; under a cached ``jax.jit`` when the request's arrays are concrete.

    ``fn`` and ``extra`` must be hashable (``extra``: names, configs, mesh, specs). The call
    runs directly, as before, when any array is a tracer (the caller is being traced:
    ``jit``, ``grad``, ``vmap``), when the arrays live on another platform than the default
    one (the dispatch asks for the platform, and while tracing it sees the default), or when
    an argument cannot be a cache key.
    """
    arrays = [getattr(request, name) for name in _ARRAY_FIELDS]
    if isinstance(request.dropout_seed, int):
        # A Python int seed becomes the uint32 scalar it stands for: a new seed reuses
        # the compiled function (the definition takes an int modulo 2**32).
        arrays[-1] = np.uint32(request.dropout_seed & 0xFFFFFFFF)
    leaves, treedef = jax.tree.flatten(arrays)
    if not all(_concrete(x) for x in leaves) or platform_of(request) != jax.default_backend():
        return fn(request, *extra)
    unique, aliases = _dedupe(leaves)
    signature = _Signature(
        fn,
        tuple(getattr(request, name) for name in _STATIC_FIELDS),
        treedef,
        aliases,
        extra,
        tuple(BACKENDS.values()),
    )
    try:
        compiled = _compiled(signature)
    except TypeError:  # an unhashable config or mesh: no cache key, run as before
        return fn(request, *extra)
    return compiled(tuple(unique))


def _dedupe(leaves: list[Any]) -> tuple[list[Any], tuple[int, ...]]:
    """The distinct arrays, and the index of each leaf among them: one jit argument per
    array, so the traced request keeps the call's identities (``cu_seqlens_k is cu_seqlens_q``)."""
    unique: list[Any] = []
    position: dict[int, int] = {}  # id -> index into unique, within this call only
    aliases = []
    for x in leaves:
        if id(x) not in position:
            position[id(x)] = len(unique)
            unique.append(x)
        aliases.append(position[id(x)])
    return unique, tuple(aliases)


def _concrete(x: Any) -> bool:
    """A value jit takes as it is: a concrete jax array, or a NumPy array of a jax dtype."""
    if isinstance(x, jax.Array):
        return not isinstance(x, jax.core.Tracer)
    if isinstance(x, np.ndarray | np.generic):
        # jit would narrow a float64 / int64 NumPy array with x64 off: run as before.
        return x.dtype == jax.dtypes.canonicalize_dtype(x.dtype)
    return False


@functools.lru_cache(maxsize=256)
def _compiled(signature: _Signature) -> Callable[[tuple[Any, ...]], Any]:
    """The jitted ``fn`` for ``signature`` (one per signature; jit keys the shapes)."""

    def run(unique: tuple[Any, ...]) -> Any:
        leaves = [unique[i] for i in signature.aliases]
        arrays = jax.tree.unflatten(signature.treedef, leaves)
        request = AttentionRequest(
            **dict(zip(_ARRAY_FIELDS, arrays, strict=True)),
            **dict(zip(_STATIC_FIELDS, signature.static_fields, strict=True)),
        )
        return signature.fn(request, *signature.extra)

    return jax.jit(run)


def eager_jit(fn: Callable[..., Any], static_argnames: tuple[str, ...]) -> Callable[..., Any]:
    """``fn``, run under one cached ``jax.jit`` per signature when its arrays are concrete.

    ``fn`` takes its arrays (or None) positionally and the ``static_argnames`` (hashable
    options) by keyword. A call runs ``fn`` directly, as before, when an array is a tracer
    (the caller is being traced), something jit would change (a list, a float64 NumPy array
    with x64 off) or on another platform than the default one, or an option is unhashable.
    Checks in ``fn`` run while tracing: they may look at shapes and dtypes, never values.
    """
    jitted = jax.jit(fn, static_argnames=static_argnames)

    @functools.wraps(fn)
    def call(*arrays: Any, **options: Any) -> Any:
        leaves = jax.tree.leaves(arrays)  # None is no leaf
        if all(_concrete(x) and _on_one_default_device(x) for x in leaves):
            try:
                hash(tuple(options.values()))
            except TypeError:
                return fn(*arrays, **options)
            return jitted(*arrays, **options)
        return fn(*arrays, **options)

    # What a test that patches a module the dispatch reads (not a cache key) calls after it.
    call.clear_cache = jitted.clear_cache  # type: ignore[attr-defined]
    return call


def _on_one_default_device(x: Any) -> bool:
    """A NumPy array (jit puts it there), or a jax array on one device of the default platform."""
    if not isinstance(x, jax.Array):
        return True
    return on_one_default_device(x.sharding)


def on_one_default_device(sharding: Any) -> bool:
    """Whether ``sharding`` places an array on one device of the default platform."""
    single = getattr(jax.sharding, "is_single_device_sharding", None)  # jax >= 0.12
    if single is not None:
        one = single(sharding)
    else:  # jax 0.12 deprecates the class (a warning on access), older jax has no test
        one = isinstance(sharding, jax.sharding.SingleDeviceSharding)
    return one and next(iter(sharding.device_set)).platform == jax.default_backend()
