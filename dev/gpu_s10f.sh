#!/usr/bin/env bash
# Session 10, last call (carry [".whl"]): Nsight Compute of the sm90 prefill, dense causal d128 (b8 x 4096) and d64
# (b16 x 2048): tensor-pipe use and stall reasons for issue 17's notes; then those two suite rows (same run, beside
# SDPA). Output: $OUT/s10f.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s10f
gpu_ncu 90 ragged ragged_d64
gpu_bench 120 'prefill/llama8b_causal_b8_s4096,prefill/d64_causal_b16_s2048'
gpu_pack s10f
