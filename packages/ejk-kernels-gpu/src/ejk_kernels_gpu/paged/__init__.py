"""Paged attention for serving: the public entry (`flash._api`), the split-KV launch and combine
(`_launch`), configs and heuristics (`flash._config`) and the executor kernel (`_executor`)."""

from ._api import paged_attention as paged_attention
from ._api import paged_attention_request as paged_attention_request
from ._api import unsupported_paged_reason as unsupported_paged_reason
from ._config import PagedConfig as PagedConfig
from ._config import paged_heuristic as paged_heuristic
from ._config import paged_search_space as paged_search_space
from ._executor import PagedAttention as PagedAttention

__all__ = [
    "PagedAttention",
    "PagedConfig",
    "paged_attention",
    "paged_attention_request",
    "paged_heuristic",
    "paged_search_space",
    "unsupported_paged_reason",
]
