#!/usr/bin/env bash
# The GPU calls that validate branch next-gpu (session 5's prepared work: main + issue17-next (sm90 soft cap,
# window, paged TMA) + issue18-graphs (sm90 MLA under CUDA graphs) + issue16-graph-cascade (graph-mode
# cascade, captured cascade serving steps)). Check the branch out in /work/main first (the device copies
# that working tree), then one `run` per call, carry [".whl"]:
#   bash dev/gpu_next_calls.sh 1   # the whole GPU suite (~300 s): correctness of everything
#   bash dev/gpu_next_calls.sh 2   # measurements (~400 s): paged TMA vs gathers, the axes, cascade, MLA, serving
# Output under $OUT. If call 1 fails in the paged sm90 tests, JITATTN_DEV_SM90_TUNING='{"paged_tma": 0}'
# isolates the TMA path; the branches can be tested one by one the same way.
set -u
source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)  # gpu_time counts from here
case "${1:-1}" in
1)
  timeout 560 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests > "$OUT/pytest.log" 2>&1
  tail -25 "$OUT/pytest.log";;
2)
  JITATTN_PREFILL_TIER=sm90 timeout 120 python3 dev/bench_paged_sm90.py --pages 16,64 --layouts NHD,HND \
    --tunings '[{"paged_tma": 0}, {}, {"paged_kv_block": 128}]' > "$OUT/paged_tma.txt" 2>&1; tail -14 "$OUT/paged_tma.txt"
  gpu_time
  JITATTN_PREFILL_TIER=sm90 timeout 90 python3 dev/bench_sm90_axes.py > "$OUT/axes.txt" 2>&1; tail -20 "$OUT/axes.txt"
  gpu_time
  timeout 90 python3 -m jitattn.bench --only 'cascade/*,mla/*,prefill/llama8b_causal_paged_b8_s4096' \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  grep -E "^(cascade|mla|prefill)/" "$OUT/bench.log" | cut -c1-150 | sort -u; gpu_time
  timeout 110 python3 examples/serve_bench.py --device cuda --model llama-3-8b-shapes --num-requests 64 \
    --system-prompt-len 2048 --output-len 64 --out "$OUT/serving_h200.md" > "$OUT/serve.log" 2>&1
  tail -8 "$OUT/serving_h200.md"; gpu_time;;
esac
