#!/usr/bin/env bash
# Session 6, first GPU call: Nsight Compute profiles of the rows that miss their targets (decode b1 x 32k beside
# SDPA's kernels, decode b256, paged vs ragged sm90 prefill, MLA 128 heads), the decode layout sweep, and the
# sm90 axes tests with the tanh.approx soft cap. Output under $OUT. carry [".whl"].
set -u
source dev/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)  # gpu_time counts from here
for c in ${CASES:-decode_b1 sdpa_b1 decode_b256 paged16 ragged mla128}; do
  timeout 120 ncu --profile-from-start off --set full --import-source no -f -o "$OUT/ncu_$c" \
    python3 dev/profile_ncu.py "$c" > "$OUT/ncu_$c.log" 2>&1
  ncu -i "$OUT/ncu_$c.ncu-rep" --page details > "$OUT/ncu_$c.txt" 2>&1
  grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occ|Block Limit|Grid Size" "$OUT/ncu_$c.txt" | head -40
  echo "$(gpu_time) $c"
done
if [ -z "${CASES:-}" ]; then
  for t in '{}' '{"mma_blocks_per_sm": 3}' '{"max_stages": 2}' '{"smem_per_sm": 160000}'; do
    echo "tuning $t"; timeout 60 python3 -m jitattn.bench.decode_cuda --tuning "$t" 2>&1 | grep -v "^layout" | tail -8
  done; gpu_time
  JITATTN_DEV_SM90_TUNING='{"soft_cap_tanh": 1}' timeout 150 python3 -m pytest -q -p no:cacheprovider -rf \
    tests/test_prefill_sm90_axes.py > "$OUT/axes_tanh1.log" 2>&1; tail -5 "$OUT/axes_tanh1.log"
  gpu_time
fi
