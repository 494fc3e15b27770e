#!/usr/bin/env bash
# Session 12, call 2 (carry [".whl"]): decode with swizzled stages on a 128-byte aligned dynamic region (swizzle 1,
# the default here) against the padded pitch (swizzle 0): the order rows, Nsight Compute's L2 tables on b256 x 4096
# and the flat shared-pages case; then the decode-side GPU files. Output: $OUT/s12b.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s12b
MET="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section LaunchStats"
KEYS="gpu__time_duration.sum|dram__bytes_read.sum |lts__t_requests_srcunit_tex_op_read.sum |lts__t_sectors_srcunit_tex_op_read.sum |lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum |l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum |smsp__inst_executed.sum "
timeout 150 python3 dev/bench_shared_order.py '{}' '{"swizzle": 0}' > $R/order.log 2>&1; cat $R/order.log; gpu_time
for c in decode_b256 flat_shared decode_b1; do
  timeout 60 ncu --profile-from-start off $MET -f -o $R/ncu_$c python3 dev/profile_ncu.py $c > $R/ncu_$c.log 2>&1
  ncu -i $R/ncu_$c.ncu-rep --page raw > $R/ncu_${c}_raw.txt 2>&1; rm -f $R/ncu_$c.ncu-rep
  echo "== $c"; grep -E "$KEYS" $R/ncu_${c}_raw.txt | sed 's/  */ /g'
done
gpu_time
gpu_tests 240 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_api_cascade.py \
  tests/test_nan_query.py tests/test_batch_invariant.py tests/test_sinks.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_pack s12b
