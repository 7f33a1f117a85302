"""Triton flash attention kernels (forward and backward) and the split-KV paged attention
kernel for serving, called from JAX.

On a GPU the kernels run through jax-triton; on a CPU through Triton's interpreter (called
with a host callback), so the same kernels are tested in CI. Subpackages by role: `flash`
(the public entry, the selection policy, the launches), `paged` (serving), `context` (the
blocks context parallelism runs), `kernels` (every Triton and Gluon kernel), `build`
(backend choice, launch, the jax-triton glue) and `aot` (sm_90 builds without a GPU).
"""

from .flash import FlashAttentionBackward as FlashAttentionBackward
from .flash import FlashAttentionForward as FlashAttentionForward
from .flash import FlashBackwardConfig as FlashBackwardConfig
from .flash import FlashConfig as FlashConfig
from .flash import attention as attention
from .flash import bwd_heuristic as bwd_heuristic
from .flash import bwd_search_space as bwd_search_space
from .flash import fits_shared_memory as fits_shared_memory
from .flash import flash_attention as flash_attention
from .flash import fwd_heuristic as fwd_heuristic
from .flash import fwd_search_space as fwd_search_space
from .flash import routes_to_decode as routes_to_decode
from .flash import unsupported_reason as unsupported_reason
from .paged import PagedAttention as PagedAttention
from .paged import PagedConfig as PagedConfig
from .paged import paged_attention as paged_attention
from .paged import paged_attention_request as paged_attention_request
from .paged import paged_heuristic as paged_heuristic
from .paged import paged_search_space as paged_search_space
from .paged import unsupported_paged_reason as unsupported_paged_reason

__all__ = [
    "FlashAttentionBackward",
    "FlashAttentionForward",
    "FlashBackwardConfig",
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
