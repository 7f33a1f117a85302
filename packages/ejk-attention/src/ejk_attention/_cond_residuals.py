"""``lax.cond`` whose gradient keeps its operand and its outputs outside the branches.

Differentiated as is, a ``lax.cond`` returns every residual its branch's backward needs
from the forward's branch: a residual that is the branch's operand (the queries, keys and
values an attention saves) or one of its outputs (the attention's output and lse) is then
copied into a buffer of its own. `cond_keeping_operands` saves the operand and the outputs
outside the conditional (the primal values themselves) and passes only the other
residuals through it. The two branches' residuals share slots where their shapes and
dtypes match; a slot only one branch fills is zeros in the other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["cond_keeping_operands"]


def cond_keeping_operands(pred: Any, true_fn: Callable, false_fn: Callable, operand: Any) -> Any:
    """``jax.lax.cond(pred, true_fn, false_fn, operand)``, differentiable in ``operand``'s
    inexact leaves, whose residuals copy neither ``operand`` nor the outputs (module
    docstring). The functions must be hashable (a custom VJP's static argument)."""
    return _cond((true_fn, false_fn), pred, operand)


def _residuals(fn: Callable, operand: Any) -> tuple[Any, list, tuple]:
    """``(out, kept, (tree, where))``: ``fn(operand)``, the residual leaves of its vjp that
    are neither operand nor output leaves, and how to put the vjp back together: its tree
    and, per leaf, ``("in", i)``, ``("out", i)`` or ``("kept", i)``."""
    out, pullback = jax.vjp(fn, operand)
    leaves, tree = jax.tree.flatten(pullback)
    ins = {id(x): i for i, x in enumerate(jax.tree.leaves(operand))}
    outs = {id(x): i for i, x in enumerate(jax.tree.leaves(out))}
    where, kept = [], []
    for leaf in leaves:
        if id(leaf) in ins:
            where.append(("in", ins[id(leaf)]))
        elif id(leaf) in outs:
            where.append(("out", outs[id(leaf)]))
        else:
            where.append(("kept", len(kept)))
            kept.append(leaf)
    return out, kept, (tree, tuple(where))


def _structure(fn: Callable, operand: Any) -> tuple[list, tuple]:
    """The shapes of ``fn``'s kept residuals and its vjp's ``(tree, where)`` (`_residuals`),
    from an abstract trace: nothing of the forward enters the current one."""
    found = []

    def trace(op):
        _, kept, structure = _residuals(fn, op)
        found.append(structure)
        return kept

    kept = jax.eval_shape(trace, operand)
    return kept, found[-1]


def _slots(branches: tuple, operand: Any) -> tuple[list, list[list[int]], list[tuple]]:
    """The residual slots the conditional passes (shape and dtype each); per branch, the
    slot of each of its kept residuals and its vjp's structure."""
    slots: list = []
    places, structures = [], []
    for fn in branches:
        kept, structure = _structure(fn, operand)
        free = list(range(len(slots)))
        place = []
        for x in kept:
            match = next((s for s in free if slots[s] == (x.shape, x.dtype)), None)
            if match is None:
                slots.append((x.shape, x.dtype))
                match = len(slots) - 1
            else:
                free.remove(match)
            place.append(match)
        places.append(place)
        structures.append(structure)
    return slots, places, structures


def _forward_branch(fn: Callable, slots: list, place: list[int]) -> Callable:
    def run(operand):
        out, kept, _ = _residuals(fn, operand)
        filled = [jnp.zeros(shape, dtype) for shape, dtype in slots]
        for x, s in zip(kept, place, strict=True):
            filled[s] = x
        return out, filled

    return run


def _backward_branch(place: list[int], structure: tuple) -> Callable:
    tree, where = structure

    def run(args):
        operand, out, filled, ct = args
        sources = {"in": jax.tree.leaves(operand), "out": jax.tree.leaves(out)}
        leaves = [filled[place[i]] if kind == "kept" else sources[kind][i] for kind, i in where]
        (d_operand,) = jax.tree.unflatten(tree, leaves)(ct)
        return [d for d in jax.tree.leaves(d_operand) if _inexact(d)]

    return run


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cond(branches: tuple, pred: Any, operand: Any) -> Any:
    return jax.lax.cond(pred, *branches, operand)


def _cond_fwd(branches: tuple, pred: Any, operand: Any) -> tuple[Any, tuple]:
    slots, places, _ = _slots(branches, operand)
    fns = [_forward_branch(fn, slots, p) for fn, p in zip(branches, places, strict=True)]
    out, filled = jax.lax.cond(pred, *fns, operand)
    return out, (pred, operand, out, filled)


def _cond_bwd(branches: tuple, res: tuple, ct: Any) -> tuple[None, Any]:
    pred, operand, out, filled = res
    _, places, structures = _slots(branches, operand)
    fns = [_backward_branch(p, st) for p, st in zip(places, structures, strict=True)]
    grads = iter(jax.lax.cond(pred, *fns, (operand, out, filled, ct)))
    leaves, tree = jax.tree.flatten(operand)
    d_leaves = [next(grads) if _inexact(x) else None for x in leaves]
    return None, jax.tree.unflatten(tree, d_leaves)


_cond.defvjp(_cond_fwd, _cond_bwd)
