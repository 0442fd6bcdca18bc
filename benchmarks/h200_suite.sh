#!/usr/bin/env bash
# The GPU-machine runs that the open issues (#5, #7) still need, in parts that each fit one device
# call (at most 10 minutes). Run from the repository root on the GPU machine, after putting numpy
# on the path (see the device README); results land in $OUT (default benchmarks/results).
#
#   bash benchmarks/h200_suite.sh tests     # every GPU test (~1 min)
#   bash benchmarks/h200_suite.sh profile   # where a decode step's time goes, Mixtral shape, replayed
#                                           # (all resident), lagged and inline at 24 GiB (~6 min)
#   bash benchmarks/h200_suite.sh mixtral   # mira bench, Mixtral shape, 64 in / 256 out: 8 and 12 GiB,
#                                           # accelerate offload, beams (~10 min; the JSON keeps what finished)
#   bash benchmarks/h200_suite.sh small     # mira bench, Qwen3-30B-A3B shape, 64 in / 256 out (~8 min)
set -euo pipefail
OUT=${OUT:-benchmarks/results}
export MIRA_CACHE=${MIRA_CACHE:-/tmp/mira-cache}
case "${1:-}" in
  tests)
    timeout 300 python -m pytest -q -s -m gpu tests/e2e/test_gpu.py tests/e2e/test_gpu_staging.py \
      tests/e2e/test_gpu_graphs.py tests/e2e/test_gpu_lagged.py -p no:cacheprovider 2>&1 \
      | grep -v "Loading weights\|Writing model" | tee "$OUT/gpu-e2e-h200.log" ;;
  profile)
    timeout 200 python benchmarks/profile_decode.py --synthetic mixtral-8x7b --budget all --prefetch off
    for residency in lagged inline; do
      timeout 200 python benchmarks/profile_decode.py --synthetic mixtral-8x7b --budget 24GiB --prefetch off \
        --residency "$residency"
    done
    cp benchmarks/results/profile-decode-*.json "$OUT/" 2>/dev/null || true ;;
  mixtral)
    timeout 580 python -m mira.cli bench --synthetic mixtral-8x7b --fixed 64x256 --budgets 8GiB,12GiB \
      --configs mira+p,mira,mira-lagged,static,lru,hf-offload --offload-budgets 12GiB --offload-new-tokens 3 \
      --beams 1,2,4,8 --beam-budget 12GiB --beam-new-tokens 64 --out "$OUT/bench-mixtral-8x7b-small-budgets.json" \
      --quiet ;;
  small)
    timeout 580 python -m mira.cli bench --synthetic qwen3-30b-a3b --fixed 64x256 --budgets 8GiB,12GiB,24GiB,all \
      --configs mira+p,mira,mira-lagged,mira-eager,static,lru,hf-gpu,hf-offload --offload-budgets 12GiB \
      --offload-new-tokens 3 --out "$OUT/bench-qwen3-30b-a3b.json" --quiet ;;
  *)
    sed -n 2,11p "$0"; exit 2 ;;
esac
