"""Test-session setup (tests only; the library sets nothing at import)."""

import os

# libtpu (used here only for deviceless compiles) takes a machine-wide lock file unless told
# that several processes may load it: two test runs at once (two Python versions, say) would
# otherwise make the second one skip its compile tests. Set before any JAX backend starts.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
