#!/usr/bin/env bash
# Prepare a bare GPU machine (the device tool's H100/H200) to run ejk from this checkout.
#
# Usage, from the repository root:  source scripts/gpu/setup.sh
#
# The machine has jax (CUDA), triton, numpy and jaxtyping but no registry access, so the
# missing wheels travel in the git-ignored .whl/ folder (carry it with the run). Fill it here:
#   python3 -m pip download msgspec==0.22.0 jax-triton==0.3.1 --no-deps --python-version 3.12 \
#     --only-binary=:all: --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl
# Every workspace package is put on PYTHONPATH from its src/ folder (no install needed).
_ejk_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/ejk-site "$_ejk_root"/.whl/*.whl || return 1 2>/dev/null || exit 1
_ejk_pp=/tmp/ejk-site
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
