"""Flash attention: the public entry (`flash_attention`, `attention`; `flash._api`), which build and
config a call gets (`flash._select`, with the config types in `flash._config`: `FlashConfig` for
the forward, `FlashBackwardConfig` for the backward), its block tables
(`_tables`), the kernels' compile-time arguments (`flash._constexprs`), the launches
(`flash._forward_launch`, `flash._backward_launch`, their order `flash._schedule`), the custom VJP (`flash._vjp`),
decoding on the split-KV kernel (`_decode`) and the executor kernels (`_executor`)."""

from ._api import attention as attention
from ._api import flash_attention as flash_attention
from ._api import unsupported_reason as unsupported_reason
from ._config import FlashBackwardConfig as FlashBackwardConfig
from ._config import FlashConfig as FlashConfig
from ._config import fits_shared_memory as fits_shared_memory
from ._executor import FlashAttentionBackward as FlashAttentionBackward
from ._executor import FlashAttentionForward as FlashAttentionForward
from ._select import bwd_heuristic as bwd_heuristic
from ._select import bwd_search_space as bwd_search_space
from ._select import fwd_heuristic as fwd_heuristic
from ._select import fwd_search_space as fwd_search_space
from ._select import routes_to_decode as routes_to_decode

__all__ = [
    "FlashAttentionBackward",
    "FlashAttentionForward",
    "FlashBackwardConfig",
    "FlashConfig",
    "attention",
    "bwd_heuristic",
    "bwd_search_space",
    "fits_shared_memory",
    "flash_attention",
    "fwd_heuristic",
    "fwd_search_space",
    "routes_to_decode",
    "unsupported_reason",
]
