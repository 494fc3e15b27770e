#!/usr/bin/env bash
# The first H200 call of a session after one without a GPU (2026-12-01, session 5): validates what that
# session landed untested and re-measures the host rows. One `run` call, ~450 s, carry [".whl"]:
#   bash dev/gpu_first_call.sh
# Results under $OUT: pytest.log (the whole GPU suite), bench.json/bench.log (the rows session 5 touched),
# bench_sm80.*, decode_split.*, host.json/host.log (jitattn.bench.host_peer, with FlashInfer when .whl/peer
# holds its wheels). Each step has its own timeout; the slowest (host_peer) runs last.
set -u
PEER=1 source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)  # gpu_time counts from here
# The whole suite (155 s in session 4) runs session 5's untested GPU tests: the MLA layout fallback, the
# cascade's per-layer path, the fp8 decode-kernel last level.
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests > "$OUT/pytest.log" 2>&1
tail -6 "$OUT/pytest.log"; gpu_time
timeout 90 python3 -m jitattn.bench --only 'cascade/*,mla/*,decode/llama8b_b1_s32768' --json "$OUT/bench.json" \
  > "$OUT/bench.log" 2>&1
grep -E "^(decode|cascade|mla)/" "$OUT/bench.log" | cut -c1-150 | sort -u; gpu_time
# Untimed question from session 4: would the sm80 tier run the cascade's shared levels faster than the sm90
# tier's cp.async gathers (b128 over 8k: 101 of 169 us)? The same rows with the tier forced:
JITATTN_PREFILL_TIER=sm80 timeout 60 python3 -m jitattn.bench --only 'cascade/*' --json "$OUT/bench_sm80.json" \
  > "$OUT/bench_sm80.log" 2>&1
grep -E "^cascade/" "$OUT/bench_sm80.log" | cut -c1-150 | sort -u; gpu_time
# issue 16's b1 x 32k (<= 40 us) and skewed (<= 70 us) rows against the split-KV chunk length (host-side:
# plan(fixed_split_size=N), no rebuild), to see whether the planner's choice is the best one:
timeout 60 python3 dev/sweep_decode_split.py --out "$OUT/decode_split.json" > "$OUT/decode_split.txt" 2>&1
cat "$OUT/decode_split.txt" | tail -20; gpu_time
# Last (FlashInfer JIT-builds its kernels here: the slowest step; the run limit cuts it, not the others):
timeout 150 python3 -m jitattn.bench.host_peer "$OUT/host.json" > "$OUT/host.log" 2>&1; tail -8 "$OUT/host.log"
gpu_time
