"""HLO labels: name scopes that survive lowering and map back to the configs used.

The executor runs every kernel inside ``jax.named_scope("ejk.<kernel>.<cfg hash>")``;
the scope lands in the ``op_name`` metadata (and the debug locations of the
StableHLO text) of every operation the kernel emits, so the configs a compiled
program was built with can be read back from its text. The hash is looked up in
a process-wide registry filled by the executor.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable
from typing import Any

import jax

from ejk_config import short_hash

__all__ = [
    "config_label",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "label",
    "labels_to_configs",
]

_PREFIX = "ejk."
_SAFE = re.compile(r"[^A-Za-z0-9_-]")
_LABEL = re.compile(r"(?<![A-Za-z0-9_.-])ejk\.[A-Za-z0-9_-]+(?:\.[0-9a-f]{16})?(?![A-Za-z0-9_-])")
_registry: dict[str, Any] = {}
_memo: dict[Any, str] = {}
_registry_lock = threading.Lock()


def _safe(name: str) -> str:
    return _SAFE.sub("_", name) or "_"


def config_label(kernel_name: str, kernel_version: str, cfg: Any) -> str:
    """The label of a kernel run with ``cfg``, registered for `labels_to_configs`."""
    memo_key: Any = (kernel_name, kernel_version, type(cfg), cfg)
    try:
        token = _memo.get(memo_key)
    except TypeError:  # an unhashable config: no memo
        memo_key, token = None, None
    if token is None:
        token = f"{_PREFIX}{_safe(kernel_name)}.{short_hash([kernel_name, kernel_version, cfg])}"
        with _registry_lock:
            _registry.setdefault(token, cfg)
            if memo_key is not None and len(_memo) < 65536:
                _memo[memo_key] = token
    return token


class label(contextlib.ContextDecorator):
    """Label the operations traced in a block or function as ``ejk.<name>``.

    Use as ``with label("attn"): ...`` or ``@label("attn")``; the label survives
    lowering and `find_labels_in_lowered` reports it.
    """

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"label name must be a non-empty str, got name={name!r}")
        self._given = name
        self.name = f"{_PREFIX}{_safe(name)}"
        self._scopes: list[Any] = []

    def _recreate_cm(self) -> label:
        # a fresh context per decorated call, so threads tracing at once never share one
        return label(self._given)

    def __enter__(self) -> str:
        scope = jax.named_scope(self.name)
        scope.__enter__()
        self._scopes.append(scope)
        return self.name

    def __exit__(self, *exc: object) -> None:
        self._scopes.pop().__exit__(*exc)


def extract_labels_from_hlo_text(text: str) -> list[str]:
    """The distinct ejk labels in HLO or StableHLO text, in order of first appearance."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return list(dict.fromkeys(_LABEL.findall(text)))


def find_labels_in_lowered(lowered: Any) -> list[str]:
    """The ejk labels of a ``jax.jit(f).lower(...)`` result (or its ``.compile()``).

    Reads the StableHLO text with debug locations, where name scopes are kept.
    """
    if isinstance(lowered, str):
        return extract_labels_from_hlo_text(lowered)
    as_text = getattr(lowered, "as_text", None)
    if as_text is None:
        raise TypeError(f"expected a jax Lowered or Compiled, got {type(lowered).__name__}")
    try:
        text = as_text(debug_info=True)
    except TypeError:  # Compiled.as_text takes no argument; its metadata has the op names
        text = as_text()
    return extract_labels_from_hlo_text(text or "")


def labels_to_configs(labels: Iterable[str]) -> dict[str, Any]:
    """Map each label to the config it was made for (None for `label` names and for
    labels made in another process)."""
    with _registry_lock:
        return {lab: _registry.get(lab) for lab in labels}
