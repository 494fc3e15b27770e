#!/usr/bin/env bash
# Session 6's GPU calls after the first (dev/gpu_profile.sh): the GPU tests of the decode and sm90 prefill
# files, the decode rows beside SDPA and the paged / ragged prefill rows (suite), the paged sm90 bench, the
# decode split sweep, Nsight Compute source counters of decode b1 and paged page 16. Output: $OUT/calls.tgz.
# carry [".whl"].
set -u
source dev/gpu_env.sh
gpu_begin calls
timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_decode_cuda.py tests/test_api_decode.py \
  tests/test_api_cascade.py tests/test_batch_invariant.py tests/test_sinks.py tests/test_nan_query.py \
  tests/test_prefill_sm90.py tests/test_prefill_sm90_axes.py tests/test_prefill_tier.py tests/test_api_prefill.py \
  > "$OUT/pytest.log" 2>&1; tail -8 "$OUT/pytest.log"; gpu_time
timeout 120 python3 -m jitattn.bench --only 'decode/*,prefill/llama8b_causal_paged_b8_s4096,prefill/llama8b_causal_b8_s4096' \
  --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(decode|prefill)/" $R/bench.log | cut -c1-125 | sort -u; gpu_time
JITATTN_PREFILL_TIER=sm90 timeout 80 python3 dev/bench_paged_sm90.py --pages 16,64 --layouts NHD --tunings '[{}]' \
  > $R/paged.txt 2>&1; tail -4 $R/paged.txt; gpu_time
timeout 60 python3 dev/sweep_decode_split.py > $R/split.txt 2>&1; cat $R/split.txt | head -12; gpu_time
for c in ${NCU_CASES:-decode_b1 paged16}; do
  timeout 80 ncu --profile-from-start off --set full --import-source no -f -o $R/$c python3 dev/profile_ncu.py $c > $R/ncu_$c.log 2>&1
  ncu -i $R/$c.ncu-rep --page details > $R/$c.txt 2>&1
  ncu -i $R/$c.ncu-rep --page source --csv --print-source sass > $R/$c.sass.csv 2>&1
  grep -E "Duration|DRAM Throughput|Executed Ipc A" $R/$c.txt | head -3
done
rm -f $R/*.ncu-rep; gpu_pack calls
