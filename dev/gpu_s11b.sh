#!/usr/bin/env bash
# Session 11, call 2 (carry [".whl"]): the sm90 prefill tier with three consumer warpgroups at head_dim 64
# (SM90_TUNING consumers_d64 3, the default in this tree): its GPU tests, the d64 suite row against two
# warpgroups (same run, beside SDPA), then decode bulk copies with one arrival per warp (bulk_copy 2) against
# cp.async. Output: $OUT/s11b.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s11b
gpu_tests 280 --maxfail=8 tests/test_prefill_sm90.py tests/test_prefill_sm90_axes.py tests/test_api_cascade.py \
  tests/test_prefill_tier.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
for c in 3 2; do
  echo "consumers_d64 $c"
  JITATTN_DEV_SM90_TUNING="{\"consumers_d64\": $c}" timeout 100 python3 -m jitattn.bench \
    --only 'prefill/d64_causal_b16_s2048' --json "$R/bench_c$c.json" > "$R/bench_c$c.log" 2>&1
  grep -E "^[a-z0-9_]+/" "$R/bench_c$c.log" | cut -c1-150 | sort -u; gpu_time
done
timeout 90 python3 dev/bench_shared_order.py '{"bulk_copy": 0}' '{"bulk_copy": 2}' > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_pack s11b
