"""The config selection chain and the autotuning policy.

Order, first answer wins:

1. the explicit ``cfg=`` of the call;
2. overlay caches (`overlay_cache`), innermost first;
3. the chain's memory cache;
4. the chain's persistent cache (a hit is copied into memory);
5. on a miss, the policy's ``on_miss``: ``"heuristic"`` (``kernel.heuristic_cfg``,
   kept in memory only, so a better heuristic in a new version is picked up),
   ``"autotune"`` (time ``kernel.config_space``, keep the winner in memory and on
   disk) or ``"error"`` (raise `ConfigNotFoundError`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

from ._cache import ConfigCache, active_overlays
from ._kernel import Invocation
from ._persistent import CacheWarning, PersistentCache
from ._tuning import tune_invocation

__all__ = [
    "AutotunePolicy",
    "ConfigNotFoundError",
    "ConfigSelectorChain",
    "Selection",
    "policy_override",
]

OnMiss = Literal["heuristic", "autotune", "error"]
_ON_MISS = ("heuristic", "autotune", "error")


class ConfigNotFoundError(LookupError):
    """No cache holds a config for the call and the policy forbids choosing one."""


@dataclasses.dataclass(frozen=True)
class AutotunePolicy:
    """What a chain does when no cache holds a config.

    Attributes:
        on_miss: "heuristic", "autotune" or "error".
        num_warmup: untimed runs per candidate when tuning.
        num_iters: timed runs per candidate (the median counts).
        max_candidates: tune at most this many candidates of the config space (None: all).
    """

    on_miss: OnMiss = "heuristic"
    num_warmup: int = 1
    num_iters: int = 5
    max_candidates: int | None = None

    def __post_init__(self) -> None:
        if self.on_miss not in _ON_MISS:
            raise ValueError(f"on_miss must be one of {_ON_MISS}, got on_miss={self.on_miss!r}")
        for name in ("num_warmup", "num_iters"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (name == "num_iters")
            ):
                raise ValueError(
                    f"{name} must be a {'positive' if name == 'num_iters' else 'non-negative'} int, got {name}={value!r}"
                )
        if self.max_candidates is not None and (
            not isinstance(self.max_candidates, int) or self.max_candidates < 1
        ):
            raise ValueError(
                f"max_candidates must be a positive int or None, got {self.max_candidates=!r}"
            )


_OVERRIDE: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "ejk_executor_policy_override", default=()
)


@contextlib.contextmanager
def policy_override(
    *, autotune: bool | None = None, on_miss: OnMiss | None = None, **fields: Any
) -> Iterator[None]:
    """Within the block, every chain uses its policy with these fields replaced.

    ``autotune=True``/``False`` is short for ``on_miss="autotune"``/``"heuristic"``;
    other keywords are `AutotunePolicy` fields. Local to the thread or task.
    """
    if autotune is not None and on_miss is not None:
        raise ValueError(f"give autotune or on_miss, not both: {autotune=}, {on_miss=}")
    if autotune is not None:
        on_miss = "autotune" if autotune else "heuristic"
    if on_miss is not None:
        fields["on_miss"] = on_miss
    known = {f.name for f in dataclasses.fields(AutotunePolicy)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"policy_override got unknown fields {unknown}; known: {sorted(known)}")
    AutotunePolicy(**fields)  # validate now, not at the first miss
    token = _OVERRIDE.set(tuple({**dict(_OVERRIDE.get()), **fields}.items()))
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


class Selection(NamedTuple):
    """A chosen config and where it came from: "explicit", "overlay", "memory",
    "persistent", "heuristic" or "autotune"."""

    cfg: Any
    source: str


class ConfigSelectorChain:
    """Chooses a config for an invocation (order in the module docstring).

    Args:
        cache: the memory cache (default: a new `ConfigCache`).
        persistent: a `PersistentCache`, or None for none.
        autotune: True for ``on_miss="autotune"``; ignored when ``policy`` is given.
        policy: the full policy.
    """

    def __init__(
        self,
        cache: ConfigCache | None = None,
        persistent: PersistentCache | None = None,
        autotune: bool = False,
        policy: AutotunePolicy | None = None,
    ):
        if cache is not None and not isinstance(cache, ConfigCache):
            raise TypeError(f"cache must be a ConfigCache or None, got {type(cache).__name__}")
        if persistent is not None and not isinstance(persistent, PersistentCache):
            raise TypeError(
                f"persistent must be a PersistentCache or None, got {type(persistent).__name__}"
            )
        if policy is None:
            policy = AutotunePolicy(on_miss="autotune" if autotune else "heuristic")
        elif not isinstance(policy, AutotunePolicy):
            raise TypeError(f"policy must be an AutotunePolicy, got {type(policy).__name__}")
        self.cache = ConfigCache() if cache is None else cache
        self.persistent = persistent
        self.policy = policy
        self._tune_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ConfigSelectorChain(persistent={self.persistent!r}, policy={self.policy!r})"

    def effective_policy(self) -> AutotunePolicy:
        """The policy with any `policy_override` in effect applied."""
        override = _OVERRIDE.get()
        return dataclasses.replace(self.policy, **dict(override)) if override else self.policy

    def lookup(self, inv: Invocation[Any, Any]) -> Selection | None:
        """Steps 2 to 4: the cached config of ``inv``, or None."""
        key = inv.call_key
        for overlay in active_overlays():
            cfg = overlay.get(key)
            if cfg is not None:
                return Selection(cfg, "overlay")
        cfg = self.cache.get(key)
        if cfg is not None:
            return Selection(cfg, "memory")
        if self.persistent is not None:
            if inv.kernel.config_type is not None:
                self.persistent.register(inv.kernel.config_type)
            cfg = _persistent_get(self.persistent, key)
            if cfg is not None:
                problem = _cached_cfg_problem(inv, cfg)
                if problem is None:
                    self.cache.put(key, cfg)
                    return Selection(cfg, "persistent")
                self.drop_cached(inv, cfg, problem)
        return None

    def drop_cached(self, inv: Invocation[Any, Any], cfg: Any, reason: str) -> bool:
        """Forget ``cfg`` for ``inv`` (memory and persistent cache) if it came from the
        persistent cache, with one `CacheWarning` giving ``reason``; whether it did.

        Called when a config read from disk cannot run the call: the next choice is then
        made without it (the heuristic, or autotuning).
        """
        key = inv.call_key
        if self.persistent is None or _persistent_get(self.persistent, key) != cfg:
            return False
        warnings.warn(
            f"config cache {self.persistent.path}: dropping the config of kernel "
            f"{inv.kernel.name!r} stored for this call ({cfg!r}): {reason}; choosing another",
            CacheWarning,
            stacklevel=3,
        )
        self.cache.discard(key)
        self.persistent.discard(key)
        return True

    def choose(self, inv: Invocation[Any, Any], cfg: Any = None) -> Selection:
        """The config for ``inv``: ``cfg`` if given, else the first answer of the chain."""
        if cfg is not None:
            return Selection(cfg, "explicit")
        found = self.lookup(inv)
        if found is not None:
            return found
        policy = self.effective_policy()
        if policy.on_miss == "error":
            raise ConfigNotFoundError(
                f"no cached config for {inv.call_key} and the policy is on_miss='error'"
            )
        if policy.on_miss == "heuristic":
            cfg = inv.kernel.heuristic_cfg(inv)
            self._check(inv, cfg, "heuristic_cfg")
            self.cache.put(inv.call_key, cfg)
            return Selection(cfg, "heuristic")
        return Selection(self.tune(inv, policy, if_missing=True), "autotune")

    def tune(
        self,
        inv: Invocation[Any, Any],
        policy: AutotunePolicy | None = None,
        *,
        if_missing: bool = False,
    ) -> Any:
        """Time ``inv``'s config space, cache the winner (memory and persistent), return it.

        With ``if_missing``, a config that reached the memory cache while this call
        waited for the tuning lock is returned instead of tuning again.
        """
        policy = self.effective_policy() if policy is None else policy
        with self._tune_lock:  # one tuning at a time: timings taken together would be noise
            if if_missing:  # another thread may have tuned this key while we waited
                cached = self.cache.get(inv.call_key)
                if cached is not None:
                    return cached
            candidates = list(inv.kernel.config_space(inv))
            if policy.max_candidates is not None:
                candidates = candidates[: policy.max_candidates]
            for c in candidates:
                self._check(inv, c, "config_space")
            best, _ = tune_invocation(
                inv, candidates, num_warmup=policy.num_warmup, num_iters=policy.num_iters
            )
            self.cache.put(inv.call_key, best)
            if self.persistent is not None:
                if inv.kernel.config_type is not None:
                    self.persistent.register(inv.kernel.config_type)
                self.persistent.put(inv.call_key, best)
        return best

    @staticmethod
    def _check(inv: Invocation[Any, Any], cfg: Any, where: str) -> None:
        if cfg is None:
            raise TypeError(f"kernel {inv.kernel.name!r}: {where} returned None")
        ctype = inv.kernel.config_type
        if ctype is not None and not isinstance(cfg, ctype):
            raise TypeError(
                f"kernel {inv.kernel.name!r}: {where} returned a {type(cfg).__name__}, "
                f"not its config_type {ctype.__name__}"
            )


def _persistent_get(persistent: PersistentCache, key: str) -> Any:
    try:
        return persistent.get(key)
    except Exception as e:  # the cache only saves time: its failure must never fail a call
        warnings.warn(
            f"config cache {persistent.path} failed ({type(e).__name__}: {e}); choosing without it",
            CacheWarning,
            stacklevel=5,
        )
        return None


def _cached_cfg_problem(inv: Invocation[Any, Any], cfg: Any) -> str | None:
    ctype = inv.kernel.config_type
    if ctype is not None and not isinstance(cfg, ctype):
        return f"it is a {type(cfg).__name__}, not the kernel's config_type {ctype.__name__}"
    try:
        return inv.kernel.cached_cfg_problem(inv, cfg)
    except Exception as e:  # a config that breaks the check itself cannot be trusted to run
        return f"checking it raised {type(e).__name__}: {e}"
