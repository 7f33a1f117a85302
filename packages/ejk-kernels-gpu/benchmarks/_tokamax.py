"""tokamax's attention as a benchmark contender, called with the arguments that mean what
ejk's do.

tokamax (``tokamax.dot_product_attention``) extends ``jax.nn.dot_product_attention``; its
GPU implementations are ``"mosaic"`` (Pallas Mosaic GPU, sm80/sm90/sm100) and ``"triton"``
(Pallas Triton), tried in that order (`GPU_IMPLEMENTATIONS`): a row names the one that ran
(``row["ran"]``) and the ones that refused (``row["refused"]``, see `_timing.contender`).
Where tokamax does not import, its rows say so (``row["skipped"]``) and nothing is timed.

How ejk's arguments map (`tokamax_arguments`, `document_starts`):

- ``causal`` -> ``is_causal`` (both top-left aligned: key ``j <= i``).
- ``sliding_window=(left, right)`` -> ``local_window_size=(left, right)``: tokamax turns
  ``(pre, post)`` into ``CausalMask(offset=post, window_size=pre + post + 1)``, keys
  ``i - pre <= j <= i + post``, the same window as ejk's ``i - left <= j <= i + right``.
- ``logits_soft_cap=c`` -> ``logits_soft_cap=c``: both ``c·tanh(logits / c)`` with
  ``logits = scale·q·kᵀ + bias``.
- packed documents as ``segment_ids``: tokamax's public call takes no segment ids (only a
  dense ``mask``, or lengths of one sequence per batch row); its kernels take per-query key
  ranges, ``Mask(k_start=..., is_causal=True)``, which it skips blocks by. With each
  document one contiguous run of ids, a query's keys ``[start of its run, i]`` are exactly
  the causal keys of equal id (`document_starts`); ids that repeat in separate runs or are
  negative (padding) are refused (`check_runs`).
- GQA (``K < N`` key/value heads) and head_dim are passed as they are (same layout
  ``[B, T, N, H]``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from ejk_sequtils import normalize_window

GPU_IMPLEMENTATIONS = ("mosaic", "triton")
_OP_NAMES = {"mosaic": "mosaic_gpu"}  # tokamax's op registry names "mosaic" on a GPU so


def load() -> tuple[Any | None, str]:
    """``(tokamax, "")``, or ``(None, why)`` where it does not import."""
    try:
        return importlib.import_module("tokamax"), ""
    except Exception as exc:  # missing, or its own imports fail (jax too old, no xprof)
        return None, f"tokamax unavailable: {type(exc).__name__}: {str(exc)[:200]}"


def tokamax_arguments(
    *, causal: bool = False, sliding_window: Any = None, logits_soft_cap: float | None = None
) -> dict[str, Any]:
    """ejk's ``causal``, ``sliding_window`` and ``logits_soft_cap`` as the keyword arguments
    of ``tokamax.dot_product_attention`` that select the same keys and logits.

    Args:
        causal: ejk's ``causal``.
        sliding_window: ejk's ``(left, right)`` or ``w`` for ``(w, w)``.
        logits_soft_cap: ejk's soft cap, or None.

    Returns:
        ``is_causal``, and ``local_window_size`` / ``logits_soft_cap`` where given.
    """
    kwargs: dict[str, Any] = {"is_causal": bool(causal)}
    window = normalize_window(sliding_window)
    if window is not None:
        kwargs["local_window_size"] = window  # (pre, post): keys i - pre .. i + post
    if logits_soft_cap is not None:
        kwargs["logits_soft_cap"] = float(logits_soft_cap)
    return kwargs


def document_starts(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Each token's first position in its run of equal ids: the ``k_start`` of tokamax's
    ``Mask`` that, with ``is_causal``, shows query ``i`` the keys ``[start, i]``.

    Traceable (the ids may be a jit argument, as ejk's are in the benchmarks).

    Args:
        segment_ids: ``[B, T]`` document ids, each document one contiguous run.

    Returns:
        int32 ``[B, T]``.
    """
    ids = jnp.asarray(segment_ids)
    positions = jnp.arange(ids.shape[-1], dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones_like(ids[..., :1], bool), ids[..., 1:] != ids[..., :-1]], -1)
    return jax.lax.cummax(jnp.where(first, positions, 0), axis=ids.ndim - 1)


def check_runs(segment_ids: Any) -> None:
    """Refuse ids that `document_starts` would not represent exactly.

    Raises:
        NotImplementedError: a negative id (padding), or an id in two separate runs of a
            row (ejk joins them into one segment; key ranges cannot).
    """
    ids = np.asarray(segment_ids)
    if (ids < 0).any():
        raise NotImplementedError("tokamax key ranges: negative (padding) segment ids")
    for row in ids:
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        if len(np.unique(row[starts])) != len(starts):
            raise NotImplementedError("tokamax key ranges: an id repeats in separate runs")


def candidates(
    implementations: tuple[str, ...] = GPU_IMPLEMENTATIONS,
    *,
    documents: bool = False,
    **ejk_kwargs: Any,
) -> tuple[dict[str, Callable[..., Any]], str]:
    """tokamax's attention under each of ``implementations``, with ejk's ``ejk_kwargs``
    converted (`tokamax_arguments`): ``({name: fn(q, k, v)}, "")``, or ``({}, why)`` where
    tokamax does not import. With ``documents`` each function takes the causal documents'
    ``segment_ids`` as a fourth argument (`document_starts`)."""
    tokamax, why = load()
    if tokamax is None:
        return {}, why
    kwargs = tokamax_arguments(**ejk_kwargs)
    if not documents:
        return {
            name: lambda q, k, v, name=name: tokamax.dot_product_attention(
                q, k, v, implementation=name, **kwargs
            )
            for name in implementations
        }, ""
    if not kwargs.pop("is_causal") or "local_window_size" in kwargs:
        raise NotImplementedError("tokamax documents: only causal, without a window")
    from tokamax._src.ops.attention import api, base  # its kernels' mask (no public name)

    def with_ranges(name: str) -> Callable[..., Any]:
        def call(q, k, v, segment_ids):
            op = api.IMPLEMENTATIONS[_OP_NAMES.get(name, name)]  # an unknown name: a row error
            mask = base.Mask(k_start=document_starts(segment_ids)[:, None, :], is_causal=True)
            return op(q, k, v, mask=mask, **kwargs)

        return call

    return {name: with_ranges(name) for name in implementations}, ""


def entries(
    row: dict,
    args: tuple,
    groups: tuple[tuple[str, ...], ...],
    *,
    documents: Any = None,
    **ejk_kwargs: Any,
) -> list[tuple]:
    """Benchmark entries ``(row, {name: fn}, args[, (segment_ids,)])`` of tokamax, one per
    group of implementations (tried in order, see `_timing.contender`), on the call ejk
    makes with ``ejk_kwargs``. Each row records tokamax's arguments (``tokamax_call``) and
    version (``tokamax_version``); where tokamax is missing or cannot express the case, ``row["skipped"]`` says why.

    Args:
        row: the shape's fields; ``impl`` becomes ``"tokamax"``.
        args: ``(q, k, v, d_out)``.
        groups: tuples of tokamax implementation names, one row each.
        documents: causal documents' ``segment_ids [B, T]`` (a jit argument), or None.
        ejk_kwargs: ejk's ``causal``, ``sliding_window``, ``logits_soft_cap``.
    """
    call = tokamax_arguments(**ejk_kwargs)
    if documents is not None:
        call = {**call, "mask": "Mask(k_start=document_starts(segment_ids), is_causal=True)"}
    side = () if documents is None else ((documents,),)
    module, _ = load()
    version = {} if module is None else {"tokamax_version": getattr(module, "__version__", "?")}
    out = []
    for group in groups:
        fields = {**row, "impl": "tokamax", "tokamax_call": call, **version}
        try:
            if documents is not None:
                check_runs(documents)
            fns, why = candidates(group, documents=documents is not None, **ejk_kwargs)
        except NotImplementedError as exc:
            fns, why = {}, f"not served: {exc}"
        except Exception as exc:  # tokamax's internals moved: the row says so, the bench goes on
            fns, why = {}, ""
            fields["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if why:
            fields["skipped"] = why
        out.append((fields, fns, args, *side))
    return out


def add_arguments(parser: Any) -> None:
    """The benchmarks' tokamax options (``--tokamax``, ``--tokamax-each``)."""
    parser.add_argument(
        "--tokamax",
        default=",".join(GPU_IMPLEMENTATIONS),
        help="tokamax implementations tried in order, the first that runs is timed "
        "('none': no tokamax rows)",
    )
    parser.add_argument(
        "--tokamax-each", action="store_true", help="one tokamax row per implementation"
    )


def groups_of(args: Any) -> tuple[tuple[str, ...], ...]:
    """The groups of `entries` the parsed ``--tokamax`` options ask for."""
    names = tuple(n for n in args.tokamax.split(",") if n and n != "none")
    if not names:
        return ()
    return tuple((n,) for n in names) if args.tokamax_each else (names,)
