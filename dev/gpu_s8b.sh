#!/usr/bin/env bash
# Session 8, call 2 (carry [".whl"]): RoPE decode on tf32 mmas (decode GPU tests, RoPE / plain rows), the
# cascade's one-wave split (cascade tests, rows, kernel profile), decode blocks-per-SM / stage tunings on the
# few-request and short-KV rows. Output: $OUT/s8b.tgz.
set -u
source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; R=/tmp/s8b; mkdir -p "$OUT" $R
T0=$(date +%s)
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_decode_cuda.py tests/test_api_cascade.py \
  > $R/pytest.log 2>&1; tail -5 $R/pytest.log
echo "t=$(( $(date +%s) - T0 ))"
timeout 100 python3 -m jitattn.bench --only 'decode/llama8b_b64_s2048,decode/llama8b_b64_s2048_rope,variants/plain_decode_b64_s4096,variants/decode_rope_b64_s4096,cascade/*' \
  --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(decode|cascade|variants)/" $R/bench.log | cut -c1-125 | sort -u; echo "t=$(( $(date +%s) - T0 ))"
timeout 40 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
echo "t=$(( $(date +%s) - T0 ))"
timeout 150 python3 dev/decode_tunings.py $R/tunings.json '{}' '{"mma_blocks_per_sm": 1, "max_stages": 6}' '{"mma_blocks_per_sm": 3}' \
  --only 'decode/llama8b_b1_s32768,decode/skewed_b64,decode/llama8b_b64_s2048,cascade/b128_shared8192_u256,cascade/b32_shared32768_u128' \
  > $R/tunings.txt 2>&1; cat $R/tunings.txt | cut -c1-150
tar czf "$OUT/s8b.tgz" -C /tmp s8b; echo "t=$(( $(date +%s) - T0 ))"
