"""Triton flash attention kernels (forward and backward) and the split-KV paged attention
kernel for serving, called from JAX.

On a GPU the kernels run through jax-triton; on a CPU through Triton's
interpreter (called with a host callback), so the same kernels are tested in CI.
"""

from ._api import attention as attention
from ._api import flash_attention as flash_attention
from ._api import unsupported_reason as unsupported_reason
from ._config import FlashConfig as FlashConfig
from ._config import bwd_heuristic as bwd_heuristic
from ._config import bwd_search_space as bwd_search_space
from ._config import fits_shared_memory as fits_shared_memory
from ._config import fwd_heuristic as fwd_heuristic
from ._config import fwd_search_space as fwd_search_space
from ._decode_route import routes_to_decode as routes_to_decode
from ._executor_kernels import FlashAttentionBackward as FlashAttentionBackward
from ._executor_kernels import FlashAttentionForward as FlashAttentionForward
from ._paged_api import paged_attention as paged_attention
from ._paged_api import paged_attention_request as paged_attention_request
from ._paged_api import unsupported_paged_reason as unsupported_paged_reason
from ._paged_config import PagedConfig as PagedConfig
from ._paged_config import paged_heuristic as paged_heuristic
from ._paged_config import paged_search_space as paged_search_space
from ._paged_executor import PagedAttention as PagedAttention

__all__ = [
    "FlashAttentionBackward",
    "FlashAttentionForward",
    "FlashConfig",
    "PagedAttention",
    "PagedConfig",
    "attention",
    "bwd_heuristic",
    "bwd_search_space",
    "fits_shared_memory",
    "flash_attention",
    "fwd_heuristic",
    "fwd_search_space",
    "paged_attention",
    "paged_attention_request",
    "paged_heuristic",
    "paged_search_space",
    "routes_to_decode",
    "unsupported_paged_reason",
    "unsupported_reason",
]
