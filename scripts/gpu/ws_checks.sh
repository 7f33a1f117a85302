#!/usr/bin/env bash
# The warp-specialisation checks that wait for a GPU (docs/performance.md, ejk-kernels-gpu
# step 6), in one run: whether causal calls may take the warp-specialised forward by default
# (`ejk_kernels_gpu._config.CAUSAL_WARP_SPECIALIZE`: bf16 conformance of that build, its
# speed beside the ordinary kernel and cuDNN in one process, the probe's mask forms), and
# whether warp-specialised backward kernels pay (probe_ws_bwd.py).
#
# Usage on the GPU machine (device tool, carry .whl), from the repository root:
#   bash scripts/gpu/ws_checks.sh
set -uo pipefail
source scripts/gpu/setup.sh
b=packages/ejk-kernels-gpu/benchmarks
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# Cases 10-12 ask for the warp-specialised config explicitly; 1 and 9 are the causal and
# the unmasked cases as the heuristics run them.
python3 "$b/gpu_conformance.py" --cases 1,9,10,11,12
python3 "$b/bench_flash.py" --only ejk,cudnn --shapes 1,2,3 \
  --fwd-cfg ";128,128,4,2,warp_specialize"
python3 "$b/probe_ws.py" --variants 2>/dev/null
python3 "$b/probe_ws_bwd.py" 2>/dev/null
