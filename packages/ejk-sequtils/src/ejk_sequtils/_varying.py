"""Which mesh axes a value varies over inside ``shard_map``, and marking results so.

Inside ``shard_map`` with its type checks on (jax's default), every value carries the
manual mesh axes it varies over. A custom call (a Triton kernel through jax-triton or a
host callback) returns values typed as the same on every device whatever its inputs; a
sharded output of such a value is then read as replicated, and its gradient summed over
the devices: silently wrong. Results of such calls are marked varying over every axis
their inputs vary over (`varying_like`), as any jnp operation on those inputs would be.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["varying_axes", "varying_like"]


def varying_axes(x: Any) -> set:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``; jax >= 0.10
    keeps them in the aval's manual axis type, earlier versions in ``vma``)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return set(manual.varying)
    return set(getattr(aval, "vma", ()))


def varying_like(tree: Any, *refs: Any) -> Any:
    """``tree`` marked varying over every mesh axis any of ``refs`` (arrays or None) varies
    over; unchanged outside ``shard_map`` or on a jax without these types."""
    axes: set = set()
    for r in refs:
        if r is not None:
            axes |= varying_axes(r)
    if not axes or not hasattr(jax.lax, "pcast"):
        return tree

    def cast(x: Any) -> Any:
        missing = tuple(sorted(axes - varying_axes(x), key=str))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)
