"""Which backend won for a shape: kept in ejk_executor's persistent cache.

``ejk tune`` times every backend that serves a request shape and stores the
fastest as a `BackendChoice` under `backend_key`; ``implementation=None`` then
tries that backend first. The key holds the abstract shapes and dtype, the
features used (they change which kernel path runs), the device fingerprint and
this package's version, never an address; the choice holds a backend name only,
so a stale or foreign entry can change speed, never numerics.

``ejk tune --op paged`` stores no backend choice (`paged_attention` reads none): it
autotunes the kernel configs of paged attention's backends for a `PagedCase`, through
the invocations the facade's own backends build for `paged_request` of the case, so the
keys stored are the ones `paged_attention` looks up for a cache of the same layout.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import warnings
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ejk_config import device_fingerprint
from ejk_executor import CacheWarning, PersistentCache, default_cache_dir
from ejk_kernels_gpu import FlashBackwardConfig, FlashConfig, PagedConfig
from ejk_kernels_gpu.flex import FlexConfig
from ejk_kernels_tpu import BlockSparseConfig, RaggedPagedConfig
from ejk_sequtils import AttentionRequest, PagedAttentionRequest, validate_paged_attention

__all__ = [
    "BackendChoice",
    "PagedCase",
    "backend_key",
    "cache_types",
    "drop_tuned_backend",
    "open_cache",
    "paged_case",
    "paged_request",
    "tuned_backend",
]


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend ``ejk tune`` measured fastest for one key (and its time)."""

    implementation: str
    ms: float = 0.0


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("ejk-attention")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "0+unknown"


def backend_key(request: AttentionRequest, fingerprint: str) -> str:
    """The persistent-cache key of the backend choice for ``request`` on ``fingerprint``."""
    b, t, s, n, k, h = request.shape
    features = ",".join(sorted(request.features())) or "none"
    return (
        f"ejk_attention.backend@{_version()}|{fingerprint}|{request.q.dtype}"
        f"|B{b}T{t}S{s}N{n}K{k}H{h}Hv{request.v.shape[-1]}|{features}"
    )


def cache_types() -> tuple[type, ...]:
    """Config classes of the ejk kernel packages, so the cache can decode them: the backend
    choice and every backend's ``config_types`` (a test holds the two lists together; a
    type missing here is stored by autotuning but never read back)."""
    return (
        BackendChoice,
        FlashConfig,
        FlashBackwardConfig,
        PagedConfig,
        FlexConfig,
        BlockSparseConfig,
        RaggedPagedConfig,
    )


@functools.cache
def _cache_at(path: Path) -> Any:
    return PersistentCache(path, types=cache_types())


def open_cache(path: str | Path | None = None, *, fresh: bool = False) -> Any:
    """The `ejk_executor.PersistentCache` at ``path`` (default: its default directory).

    The same object is reused per path (it keeps what it read in memory); ``fresh=True``
    opens a new one, which sees entries removed on disk since (the CLI uses it).
    """
    where = Path(path if path is not None else default_cache_dir()).expanduser()
    if fresh:
        _cache_at.cache_clear()
        return PersistentCache(where, types=cache_types())
    return _cache_at(where)


def tuned_backend(request: AttentionRequest) -> str | None:
    """The tuned backend for ``request`` on this machine, or None (no entry, no executor)."""
    choice = open_cache().get(backend_key(request, device_fingerprint()))
    return choice.implementation if isinstance(choice, BackendChoice) else None


def drop_tuned_backend(request: AttentionRequest, reason: str) -> None:
    """Remove the stored backend choice for ``request`` (it failed), with one CacheWarning."""
    cache = open_cache()
    warnings.warn(
        f"config cache {cache.path}: dropping the backend choice for this call: {reason}; "
        "running the platform's order",
        CacheWarning,
        stacklevel=4,
    )
    cache.discard(backend_key(request, device_fingerprint()))


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """One `paged_attention` call shape, on a cache of one layout.

    Attributes:
        case: the ``ejk_attention._bench.BenchCase`` ``B,T,S,N,K,H`` and dtype: ``B``
            sequences of ``S`` keys, their ``T`` new tokens included.
        page_size, pages_per_seq, num_pages: the `PagedKVCache.create` arguments of the
            cache (``max_seqs = B``).
        ragged: the `ragged_paged_attention` form (q packed ``[B * T, N, H]``, ``cu_q_lens``).
    """

    case: Any
    page_size: int
    pages_per_seq: int
    num_pages: int
    ragged: bool = False

    @property
    def label(self) -> str:
        form = " ragged" if self.ragged else ""
        return (
            f"{self.case.label} pages {self.num_pages}x{self.page_size} "
            f"({self.pages_per_seq}/seq){form}"
        )


def paged_case(
    case: Any,
    *,
    page_size: int,
    pages_per_seq: int | None = None,
    num_pages: int | None = None,
    ragged: bool = False,
) -> PagedCase:
    """The `PagedCase` of a ``B,T,S,N,K,H`` `BenchCase` (S: each sequence's keys, its T
    new ones included) in pages of ``page_size``.

    Args:
        case: the shape and dtype (``ejk_attention._bench.BenchCase``), not causal
            (paged attention always is, bottom-right).
        page_size: tokens per page.
        pages_per_seq: the page table's row length; default: the fewest that hold S keys.
        num_pages: pages in the pool; default ``B * pages_per_seq``.
        ragged: the `ragged_paged_attention` form.

    Raises:
        ValueError: a shape no cache of these pages holds (the message names it).
    """
    s, t, b = case.kv_len, case.q_len, case.batch
    if case.causal:
        raise ValueError(
            f"paged attention is always causal (bottom-right): drop ',causal' from {case.label!r}"
        )
    if t > s:
        raise ValueError(f"S={s} keys per sequence include its T={t} new tokens: need T <= S")
    needed = -(-s // page_size)
    pages_per_seq = needed if pages_per_seq is None else pages_per_seq
    if pages_per_seq < needed:
        raise ValueError(
            f"S={s} keys take {needed} pages of {page_size} per sequence, more than "
            f"--pages-per-seq {pages_per_seq}"
        )
    num_pages = b * pages_per_seq if num_pages is None else num_pages
    if num_pages < b * needed:
        raise ValueError(
            f"B={b} sequences of S={s} keys take {b * needed} pages of {page_size}, more than "
            f"--num-pages {num_pages}"
        )
    return PagedCase(case, page_size, pages_per_seq, num_pages, ragged)


def paged_request(case: PagedCase, seed: int = 0) -> PagedAttentionRequest:
    """The validated request of a `paged_attention` call of ``case`` on concrete arrays
    (on the default device): random q and pages, each sequence's pages drawn without
    replacement from the pool in a shuffled order (as a serving cache holds them),
    ``kv_lens = S``. Tuning times these values: arrays, not stand-ins."""
    rng = np.random.default_rng(seed)
    shape = case.case
    dtype = jnp.dtype(shape.dtype)
    b, t, n, h = shape.batch, shape.q_len, shape.heads, shape.head_dim
    pool = (case.num_pages, case.page_size, shape.kv_heads, h)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal(pool), dtype) for _ in "kv")
    used = -(-shape.kv_len // case.page_size)
    table = np.zeros((b, case.pages_per_seq), np.int32)
    table[:, :used] = rng.permutation(case.num_pages)[: b * used].reshape(b, used)
    q_shape = (b * t, n, h) if case.ragged else (b, t, n, h)
    return validate_paged_attention(
        jnp.asarray(rng.standard_normal(q_shape), dtype),
        k_pages,
        v_pages,
        jnp.asarray(table),
        jnp.full((b,), shape.kv_len, jnp.int32),
        cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32) * t if case.ragged else None,
    )
