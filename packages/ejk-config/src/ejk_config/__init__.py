"""msgspec config carriers, stable hashing and device fingerprints for ejk kernels."""

from ._device import abstractify as abstractify
from ._device import device_fingerprint as device_fingerprint
from ._device import device_kind as device_kind
from ._device import get_device_platform as get_device_platform
from ._hashing import get_safe_hash_int as get_safe_hash_int
from ._hashing import hash_fn as hash_fn
from ._hashing import short_hash as short_hash
from ._hashing import stable_json as stable_json
from ._params import BwdParams as BwdParams
from ._params import FwdParams as FwdParams
from ._params import from_json as from_json
from ._params import to_dict as to_dict
from ._params import to_json as to_json

__all__ = [
    "BwdParams",
    "FwdParams",
    "abstractify",
    "device_fingerprint",
    "device_kind",
    "from_json",
    "get_device_platform",
    "get_safe_hash_int",
    "hash_fn",
    "short_hash",
    "stable_json",
    "to_dict",
    "to_json",
]
