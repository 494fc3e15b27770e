#!/usr/bin/env bash
# Session 11, call 3 (carry [".whl"]): softmax exponentials partly on the FMA pipes (SM90_TUNING exp_poly) in
# the sm90 prefill: the d64 and d128 causal suite rows with exp_poly 0 / 2 / 4 (same run, beside SDPA), the
# sm90 prefill GPU files with exp_poly 2, Nsight Compute of d64 (three consumer warpgroups, exp_poly 0).
# Output: $OUT/s11c.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s11c
for e in 0 2 4; do
  echo "exp_poly $e"
  JITATTN_DEV_SM90_TUNING="{\"exp_poly\": $e}" timeout 120 python3 -m jitattn.bench \
    --only 'prefill/d64_causal_b16_s2048,prefill/llama8b_causal_b8_s4096' --json "$R/bench_e$e.json" > "$R/bench_e$e.log" 2>&1
  grep -E "^[a-z0-9_]+/" "$R/bench_e$e.log" | cut -c1-150 | sort -u; gpu_time
done
JITATTN_DEV_SM90_TUNING='{"exp_poly": 2}' gpu_tests 240 --maxfail=8 tests/test_prefill_sm90.py \
  tests/test_prefill_sm90_axes.py tests/test_api_cascade.py tests/test_nan_query.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_ncu 60 ragged_d64
grep -E "pipe_xu|pipe_fma_cycles|pipe_alu_cycles" "$R/ncu_ragged_d64_raw.txt" | grep -E "pct_of_peak_sustained_active" | head -8
gpu_pack s11c
