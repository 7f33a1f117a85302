#!/usr/bin/env bash
# The warp-specialisation checks (docs/performance-history.md, ejk-kernels-gpu steps 6-7), in one
# run: bf16 conformance of the warp-specialised builds (the heuristics' choice on Hopper for
# unmasked and causal calls at head_dim 128), their speed beside the ordinary kernels and
# cuDNN in one process (interleaved). The probe kernels of those steps live in git history
# (docs/performance-history.md says where).
#
# Usage on the GPU machine (device tool, carry .whl), from the repository root:
#   bash scripts/gpu/ws_checks.sh
set -uo pipefail
source scripts/gpu/setup.sh
b=packages/ejk-kernels-gpu/benchmarks
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# Cases 10-14 ask for the warp-specialised configs explicitly (10-12 the causal forward,
# 13-14 the backward too); 1 and 9: the causal and unmasked cases as the heuristics run
# them; 15-16: the ordinary kernels on those calls.
python3 "$b/gpu_conformance.py" --cases 1,9,10,11,12,13,14,15,16
# The heuristics' configs, then the ordinary ones they replace (forward; backward).
python3 "$b/bench_flash.py" --only ejk,cudnn --shapes 0,1,2,3 \
  --fwd-cfg ";128,128,8,3" --bwd-cfg ";128,64,8,3,atomic_dq"
