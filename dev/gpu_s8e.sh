#!/usr/bin/env bash
# Session 8, call 5 (carry [".whl"]): the in-kernel cascade merge with its prior states prefetched to L1:
# cascade GPU tests, cascade and decode rows, the cascade kernel profile. Output: $OUT/s8e.tgz.
set -u
source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; R=/tmp/s8e; mkdir -p "$OUT" $R
T0=$(date +%s)
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_api_cascade.py tests/test_decode_cuda.py \
  > $R/pytest.log 2>&1; tail -3 $R/pytest.log
echo "t=$(( $(date +%s) - T0 ))"
timeout 60 python3 -m jitattn.bench --only 'decode/llama8b_b64_s2048,cascade/*' --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(decode|cascade)/" $R/bench.log | cut -c1-125 | sort -u; echo "t=$(( $(date +%s) - T0 ))"
timeout 30 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
tar czf "$OUT/s8e.tgz" -C /tmp s8e; echo "t=$(( $(date +%s) - T0 ))"
