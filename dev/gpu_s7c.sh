#!/usr/bin/env bash
# Session 7, final call (carry [".whl"]): the whole GPU suite (the decode template's ignore-src copies and
# ex2.approx since the last one), the cascade shared level in whole 128-token KV blocks (kernel times per
# chunk size), the decode and cascade suite rows. Output: $OUT/s7c.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s7c
gpu_tests 270 tests
gpu_bench 130 'decode/llama8b_b64_s2048,decode/llama8b_b256_s4096,decode/llama8b_b1_s32768,decode/mha_b64_s2048_d128,decode/phi3_d96_b64_s4096,decode/skewed_b64,decode/fp8kv_b256_s4096,decode/gptoss_b64_s8192,decode/llama8b_b64_s2048_rope,decode/llama8b_b64_s2048_page1,cascade/*'
timeout 50 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
gpu_pack s7c
