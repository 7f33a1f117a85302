"""Kernel/Invocation/Executor, config selection chain, persistent cache and autotuning for JAX kernels."""

from ._batch import pmap_with_config as pmap_with_config
from ._batch import vmap_with_config as vmap_with_config
from ._cache import ConfigCache as ConfigCache
from ._cache import overlay_cache as overlay_cache
from ._executor import Executor as Executor
from ._files import write_atomic as write_atomic
from ._kernel import Invocation as Invocation
from ._kernel import Kernel as Kernel
from ._kernel import default_key_builder_with_sharding as default_key_builder_with_sharding
from ._kernel import sharding_fingerprint as sharding_fingerprint
from ._labels import extract_labels_from_hlo_text as extract_labels_from_hlo_text
from ._labels import find_labels_in_lowered as find_labels_in_lowered
from ._labels import label as label
from ._labels import labels_to_configs as labels_to_configs
from ._persistent import CacheWarning as CacheWarning
from ._persistent import PersistentCache as PersistentCache
from ._persistent import default_cache_dir as default_cache_dir
from ._registry import autotune_recorded as autotune_recorded
from ._registry import clear_invocations as clear_invocations
from ._registry import get_invocations as get_invocations
from ._registry import record_invocation as record_invocation
from ._selection import AutotunePolicy as AutotunePolicy
from ._selection import ConfigNotFoundError as ConfigNotFoundError
from ._selection import ConfigSelectorChain as ConfigSelectorChain
from ._selection import Selection as Selection
from ._selection import policy_override as policy_override
from ._tuning import autotune as autotune
from ._tuning import benchmark as benchmark
from ._tuning import get_memory_usage as get_memory_usage
from ._tuning import timer as timer

__all__ = [
    "AutotunePolicy",
    "CacheWarning",
    "ConfigCache",
    "ConfigNotFoundError",
    "ConfigSelectorChain",
    "Executor",
    "Invocation",
    "Kernel",
    "PersistentCache",
    "Selection",
    "autotune",
    "autotune_recorded",
    "benchmark",
    "clear_invocations",
    "default_cache_dir",
    "default_key_builder_with_sharding",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "get_invocations",
    "get_memory_usage",
    "label",
    "labels_to_configs",
    "overlay_cache",
    "pmap_with_config",
    "policy_override",
    "record_invocation",
    "sharding_fingerprint",
    "timer",
    "vmap_with_config",
    "write_atomic",
]
