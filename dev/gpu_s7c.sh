#!/usr/bin/env bash
# Session 7, final call (carry [".whl"]): the whole GPU suite (the decode template's ignore-src copies and
# ex2.approx since the last one), the cascade shared level in whole 128-token KV blocks (kernel times per
# chunk size), the decode and cascade suite rows. Output: $OUT/s7c.tgz.
set -u
source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; R=/tmp/s7c; mkdir -p "$OUT" $R
T0=$(date +%s)
timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests > $R/pytest.log 2>&1; tail -4 $R/pytest.log
echo "t=$(( $(date +%s) - T0 ))"
timeout 130 python3 -m jitattn.bench --only 'decode/llama8b_b64_s2048,decode/llama8b_b256_s4096,decode/llama8b_b1_s32768,decode/mha_b64_s2048_d128,decode/phi3_d96_b64_s4096,decode/skewed_b64,decode/fp8kv_b256_s4096,decode/gptoss_b64_s8192,decode/llama8b_b64_s2048_rope,decode/llama8b_b64_s2048_page1,cascade/*' \
  --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(decode|cascade)/" $R/bench.log | cut -c1-125 | sort -u; echo "t=$(( $(date +%s) - T0 ))"
timeout 50 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
tar czf "$OUT/s7c.tgz" -C /tmp s7c; echo "t=$(( $(date +%s) - T0 ))"
