#!/usr/bin/env bash
# Session 8, call 6 (carry [".whl"]): the review fixes (work-slot export, warp 0's __syncwarp in the sm90
# producer, new sm90 and cascade GPU tests). Output: $OUT/s8f.tgz.
set -u
source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; R=/tmp/s8f; mkdir -p "$OUT" $R
T0=$(date +%s)
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_prefill_sm90.py tests/test_api_cascade.py \
  > $R/pytest.log 2>&1; tail -4 $R/pytest.log
tar czf "$OUT/s8f.tgz" -C /tmp s8f; echo "t=$(( $(date +%s) - T0 ))"
