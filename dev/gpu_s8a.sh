#!/usr/bin/env bash
# Session 8, call 1 (carry [".whl"]): the sm90 prefill tier's dynamic items (work counter + ring):
# prefill / cascade GPU tests, prefill and cascade suite rows, the cascade chunk-size sweep. Output: $OUT/s8a.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s8a
gpu_tests 230 tests/test_prefill_sm90.py tests/test_prefill_sm90_axes.py tests/test_prefill_cuda.py tests/test_api_cascade.py
gpu_bench 150 'prefill/llama8b_causal_b8_s4096,prefill/d64_causal_b16_s2048,prefill/d256_causal_b4_s4096,prefill/llama8b_noncausal_b8_s4096,prefill/llama8b_causal_paged_b8_s4096,prefill/llama8b_causal_varlen,cascade/*'
timeout 100 python3 dev/profile_cascade.py --sweep > $R/sweep.txt 2>&1; cut -c1-150 $R/sweep.txt | tail -22
gpu_pack s8a
