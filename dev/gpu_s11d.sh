#!/usr/bin/env bash
# Session 11, call 4 (carry [".whl"]): KV block and pipeline depth of the sm90 prefill with three consumer
# warpgroups (d64) and of d128 (SM90_TUNING kv_block / kv_stages), the suite rows per tuning (same run, beside
# SDPA); the d64 kernel's SASS (where its spills are). Output: $OUT/s11d.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s11d
for t in '{}' '{"kv_stages": 3}' '{"kv_stages": 4}' '{"kv_block": 96}' '{"kv_block": 96, "kv_stages": 3}'; do
  echo "d64 $t"
  JITATTN_DEV_SM90_TUNING="$t" timeout 60 python3 -m jitattn.bench --only 'prefill/d64_causal_b16_s2048' \
    > "$R/bench.log" 2>&1
  grep -E "^[a-z0-9_]+/" "$R/bench.log" | cut -c1-150 | sort -u; gpu_time
done
for t in '{}' '{"kv_block": 128, "kv_stages": 3}'; do
  echo "d128 $t"
  JITATTN_DEV_SM90_TUNING="$t" timeout 60 python3 -m jitattn.bench --only 'prefill/llama8b_causal_b8_s4096' \
    > "$R/bench.log" 2>&1
  grep -E "^[a-z0-9_]+/" "$R/bench.log" | cut -c1-150 | sort -u; gpu_time
done
python3 - > "$R/sass_d64.txt" 2>&1 <<'PY'
import os, subprocess, torch
os.environ["JITATTN_PREFILL_TIER"] = "sm90"
import jitattn
from jitattn.spec import VariantSpec
spec = VariantSpec(op="prefill", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", head_dim_qk=64,
                   head_dim_vo=64, group_size=4, pos_encoding="none", use_sliding_window=False, use_logits_soft_cap=False,
                   mask_mode="causal", kv_layout="nhd", kv_storage="ragged")
path = jitattn.load(spec).path
print(path)
print(subprocess.run(["cuobjdump", "-sass", str(path)], capture_output=True, text=True).stdout)
PY
grep -c "STL\|LDL" "$R/sass_d64.txt"; gpu_time
gpu_pack s11d
