#!/usr/bin/env bash
# Session 8, call 6 (carry [".whl"]): the review fixes (work-slot export, warp 0's __syncwarp in the sm90
# producer, new sm90 and cascade GPU tests). Output: $OUT/s8f.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s8f
gpu_tests 150 tests/test_prefill_sm90.py tests/test_api_cascade.py
gpu_pack s8f
