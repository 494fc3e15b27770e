#!/usr/bin/env bash
# Session 6's last GPU call: the whole GPU suite on this commit, the decode / prefill / cascade suite rows beside
# SDPA, and the split sweep (the few-request rule against the rule before it). Output: $OUT/final.tgz.
set -u
source dev/gpu_env.sh
gpu_begin final
timeout 60 python3 dev/sweep_decode_split.py > $R/split.txt 2>&1; cat $R/split.txt; gpu_time
timeout 130 python3 -m jitattn.bench --only 'decode/*,prefill/llama8b_causal_paged_b8_s4096,prefill/llama8b_causal_b8_s4096,cascade/*' \
  --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(decode|prefill|cascade)/" $R/bench.log | cut -c1-125 | sort -u; gpu_time
gpu_pack final
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests > "$R/pytest.log" 2>&1; tail -15 "$R/pytest.log"
gpu_pack final
