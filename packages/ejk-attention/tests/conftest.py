"""Test setup: 8 host CPU devices for the sharded and ring tests.

XLA reads the flag when its CPU backend starts, so it is set here, before any
test touches a device. Only the tests do this; the package never sets flags.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
