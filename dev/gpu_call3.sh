#!/usr/bin/env bash
# Session 6, third GPU call: decode with the row-address table (one shared load per K/V row pair, no offset
# arithmetic per copy) and the lazy O rescale; sm90 paged prefill with the TMA boxes issued by all 4 producer
# warps. GPU tests of both, the decode rows beside SDPA, the paged rows, the decode layout sweep, one ncu
# report of decode b1. Output under $OUT (call3.tgz). carry [".whl"].
set -u
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .pysite "$@"; }
pip_target .whl/*.whl
export PYTHONPATH=$PWD/.pysite:$PWD PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc FLASHINFER_WORKSPACE_BASE=/tmp/fi
OUT=${OUT:-/tmp/out}; R=/tmp/call3; mkdir -p "$OUT" $R
T0=$(date +%s)
timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_decode_cuda.py tests/test_api_decode.py \
  tests/test_api_cascade.py tests/test_batch_invariant.py tests/test_sinks.py tests/test_nan_query.py \
  tests/test_prefill_sm90.py tests/test_prefill_sm90_axes.py tests/test_prefill_tier.py tests/test_api_prefill.py \
  > "$OUT/pytest.log" 2>&1; tail -8 "$OUT/pytest.log"; echo "t=$(( $(date +%s) - T0 ))"
timeout 120 python3 -m jitattn.bench --only 'decode/*,prefill/llama8b_causal_paged_b8_s4096,prefill/llama8b_causal_b8_s4096' \
  --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(decode|prefill)/" $R/bench.log | cut -c1-125 | sort -u; echo "t=$(( $(date +%s) - T0 ))"
JITATTN_PREFILL_TIER=sm90 timeout 80 python3 dev/bench_paged_sm90.py --pages 16,64 --layouts NHD --tunings '[{}]' \
  > $R/paged.txt 2>&1; tail -6 $R/paged.txt; echo "t=$(( $(date +%s) - T0 ))"
for t in '{"mma_blocks_per_sm": 3}'; do
  echo "tuning $t"; timeout 60 python3 -m jitattn.bench.decode_cuda --tuning "$t" 2>&1 | grep -v "^layout" | tail -8
done; echo "t=$(( $(date +%s) - T0 ))"
timeout 60 python3 dev/sweep_decode_split.py > $R/split.txt 2>&1; cat $R/split.txt | head -12; echo "t=$(( $(date +%s) - T0 ))"
timeout 80 ncu --profile-from-start off --set full --import-source no -f -o $R/decode_b1 python3 dev/profile_ncu.py decode_b1 > $R/ncu.log 2>&1
ncu -i $R/decode_b1.ncu-rep --page details > $R/decode_b1.txt 2>&1
ncu -i $R/decode_b1.ncu-rep --page source --csv --print-source sass > $R/decode_b1.sass.csv 2>&1
grep -E "Duration|DRAM Throughput|Executed Ipc A|Registers" $R/decode_b1.txt | head -4
rm -f $R/*.ncu-rep; tar czf "$OUT/call3.tgz" -C /tmp call3; echo "t=$(( $(date +%s) - T0 ))"
