#!/usr/bin/env bash
# Session 8, call 1 (carry [".whl"]): the sm90 prefill tier's dynamic items (work counter + ring):
# prefill / cascade GPU tests, prefill and cascade suite rows, the cascade chunk-size sweep. Output: $OUT/s8a.tgz.
set -u
source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; R=/tmp/s8a; mkdir -p "$OUT" $R
T0=$(date +%s)
timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_prefill_sm90.py tests/test_prefill_sm90_axes.py \
  tests/test_prefill_cuda.py tests/test_api_cascade.py > $R/pytest.log 2>&1; tail -5 $R/pytest.log
echo "t=$(( $(date +%s) - T0 ))"
timeout 150 python3 -m jitattn.bench --only 'prefill/llama8b_causal_b8_s4096,prefill/d64_causal_b16_s2048,prefill/d256_causal_b4_s4096,prefill/llama8b_noncausal_b8_s4096,prefill/llama8b_causal_paged_b8_s4096,prefill/llama8b_causal_varlen,cascade/*' \
  --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(prefill|cascade)/" $R/bench.log | cut -c1-125 | sort -u; echo "t=$(( $(date +%s) - T0 ))"
timeout 100 python3 dev/profile_cascade.py --sweep > $R/sweep.txt 2>&1; cut -c1-150 $R/sweep.txt | tail -22
tar czf "$OUT/s8a.tgz" -C /tmp s8a; echo "t=$(( $(date +%s) - T0 ))"
