#!/usr/bin/env bash
# Prepare a bare GPU machine (the device tool's H100/H200) to run ejk from this checkout.
#
# Usage, from the repository root:  source scripts/gpu/setup.sh
#
# The machine has jax (CUDA), triton, numpy, jaxtyping, flax, absl-py and protobuf but no
# registry access, so the missing wheels travel in the git-ignored .whl/ folder (carry it
# with the run): msgspec and jax-triton for ejk, tokamax and its needs the image lacks for the
# benchmarks' tokamax rows. Fill it here (one version of each; about 6 MB):
#   python3 -m pip download msgspec==0.22.0 jax-triton==0.3.1 tokamax==0.0.17 pydantic==2.12.5 \
#     pydantic-core==2.41.5 annotated-types==0.8.0 typing-inspection==0.4.2 einshape==1.0 \
#     qwix==0.1.8 immutabledict==4.3.1 tensorboardx==2.6.5 typeguard==2.13.3 \
#     --no-deps --python-version 3.12 --only-binary=:all: --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl
# (pydantic 2.12 needs typing-extensions >= 4.14.1 only; tokamax's xprof is profiling-only
# and gets the stand-in below.)
# Every workspace package is put on PYTHONPATH from its src/ folder (no install needed).
_ejk_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/ejk-site "$_ejk_root"/.whl/*.whl || return 1 2>/dev/null || exit 1
_ejk_pp=/tmp/ejk-site
# tokamax imports xprof.cli.tools.get_kernel_stats_tool at import time, for its profiling
# timers only (the benchmarks time with their own clock): where the machine has no xprof,
# a stand-in that refuses to profile lets tokamax import.
if ! python3 -c "import xprof.cli.tools" 2>/dev/null; then
  mkdir -p /tmp/ejk-site/xprof/cli
  : >/tmp/ejk-site/xprof/__init__.py
  : >/tmp/ejk-site/xprof/cli/__init__.py
  cat >/tmp/ejk-site/xprof/cli/tools.py <<'PY'
"""Stand-in for xprof (not on this machine): tokamax imports it; profiling is refused."""


def get_kernel_stats_tool(*args, **kwargs):
    raise NotImplementedError("xprof is not installed on this machine (ejk's stand-in)")
PY
fi
# Optional: EJK_TRITON=<version> puts a carried Triton (.whl/triton-<version>.tar.xz, made by
# scripts/gpu/triton_trimmed.sh) ahead of the machine's own.
if [ -n "${EJK_TRITON:-}" ]; then
  mkdir -p /tmp/ejk-triton && tar xJf "$_ejk_root/.whl/triton-$EJK_TRITON.tar.xz" -C /tmp/ejk-triton \
    || return 1 2>/dev/null || exit 1
  _ejk_pp="/tmp/ejk-triton:$_ejk_pp"
fi
for _d in "$_ejk_root"/packages/*/src; do _ejk_pp="$_ejk_pp:$_d"; done
export PYTHONPATH="$_ejk_pp${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Leave JAX's allocator with room for the XLA/cuDNN baselines in the benchmark.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
unset _d _ejk_pp _ejk_root
