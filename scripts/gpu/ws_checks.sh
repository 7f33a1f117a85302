#!/usr/bin/env bash
# The warp-specialisation checks that wait for a GPU (docs/performance.md, ejk-kernels-gpu
# step 6), in one run: whether causal calls may take the warp-specialised forward by default
# and whether the warp-specialised backward should be offered (`ejk_kernels_gpu._config`'s
# CAUSAL_WARP_SPECIALIZE and WARP_SPECIALIZED_BACKWARD): bf16 conformance of those builds,
# their speed beside the ordinary kernels and cuDNN in one process, the probes.
#
# Usage on the GPU machine (device tool, carry .whl), from the repository root:
#   bash scripts/gpu/ws_checks.sh [library|probes|all]
# All of it takes about 9 minutes, near the device tool's 10-minute limit per command:
# run "library" (conformance and speed) and "probes" as two calls.
set -uo pipefail
part="${1:-all}"
source scripts/gpu/setup.sh
b=packages/ejk-kernels-gpu/benchmarks
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "$part" = library ] || [ "$part" = all ]; then
  # Cases 10-14 ask for the warp-specialised configs explicitly (10-12 the causal forward,
  # 13-14 the backward too); 1 and 9: the causal and unmasked cases as the heuristics run them.
  python3 "$b/gpu_conformance.py" --cases 1,9,10,11,12,13,14
  python3 "$b/bench_flash.py" --only ejk,cudnn --shapes 0,1,2,3 \
    --fwd-cfg ";128,128,4,2,warp_specialize" --bwd-cfg ";128,64,4,2,warp_specialize"
fi
if [ "$part" = probes ] || [ "$part" = all ]; then
  python3 "$b/probe_ws.py" --variants 2>/dev/null
  python3 "$b/probe_ws_bwd.py" 2>/dev/null
fi
