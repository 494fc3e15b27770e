#!/usr/bin/env bash
# Session 8, call 5 (carry [".whl"]): the in-kernel cascade merge with its prior states prefetched to L1:
# cascade GPU tests, cascade and decode rows, the cascade kernel profile. Output: $OUT/s8e.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s8e
gpu_tests 100 tests/test_api_cascade.py tests/test_decode_cuda.py
gpu_bench 60 'decode/llama8b_b64_s2048,cascade/*'
timeout 30 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
gpu_pack s8e
