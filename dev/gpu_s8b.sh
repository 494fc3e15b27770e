#!/usr/bin/env bash
# Session 8, call 2 (carry [".whl"]): RoPE decode on tf32 mmas (decode GPU tests, RoPE / plain rows), the
# cascade's one-wave split (cascade tests, rows, kernel profile), decode blocks-per-SM / stage tunings on the
# few-request and short-KV rows. Output: $OUT/s8b.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s8b
gpu_tests 240 tests/test_decode_cuda.py tests/test_api_cascade.py
gpu_bench 100 'decode/llama8b_b64_s2048,decode/llama8b_b64_s2048_rope,variants/plain_decode_b64_s4096,variants/decode_rope_b64_s4096,cascade/*'
timeout 40 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
gpu_time
timeout 150 python3 dev/decode_tunings.py $R/tunings.json '{}' '{"mma_blocks_per_sm": 1, "max_stages": 6}' '{"mma_blocks_per_sm": 3}' \
  --only 'decode/llama8b_b1_s32768,decode/skewed_b64,decode/llama8b_b64_s2048,cascade/b128_shared8192_u256,cascade/b32_shared32768_u128' \
  > $R/tunings.txt 2>&1; cat $R/tunings.txt | cut -c1-150
gpu_pack s8b
