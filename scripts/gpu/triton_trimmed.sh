#!/usr/bin/env bash
# Pack a Triton release small enough to carry to the GPU machine (its 64 MiB limit), for
# trying a newer Triton than the machine's own (see setup.sh, EJK_TRITON).
#
# Usage, from the repository root:  scripts/gpu/triton_trimmed.sh 3.8.0
# Writes .whl/triton-<version>.tar.xz (~50 MB): the cp312 manylinux wheel's triton/ folder
# with libtriton stripped of its symbols and without what compiling for and launching on an
# sm_90 GPU does not use (CUPTI, the proton profiler, Blackwell's ptxas, cuobjdump,
# nvdisasm, instrumentation). The AMD backend stays: Triton's backend discovery imports it.
set -euo pipefail
version="${1:?usage: $0 <triton version>}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q "triton==$version" --no-deps --python-version 3.12 \
  --only-binary=:all: --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 -d "$work"
python3 -m zipfile -e "$work"/triton-*.whl "$work/site"
t="$work/site/triton"
rm -rf "$t"/backends/nvidia/lib/cupti* "$t"/backends/nvidia/bin/ptxas-blackwell \
  "$t"/backends/nvidia/bin/cuobjdump "$t"/backends/nvidia/bin/nvdisasm \
  "$t"/_C/libproton.so "$t"/instrumentation
strip --strip-unneeded "$t"/_C/libtriton.so
chmod +x "$t"/backends/nvidia/bin/ptxas
mkdir -p "$root/.whl"
tar cf - -C "$work/site" triton | xz -9 -T0 > "$root/.whl/triton-$version.tar.xz"
ls -l "$root/.whl/triton-$version.tar.xz"
