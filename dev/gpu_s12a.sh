#!/usr/bin/env bash
# Session 12, call 1 (carry [".whl"]): decode's L2 requests. dev/l2_stream.cu (the decode kernel's copy pattern
# alone, shared-memory layouts x cp.async forms): timing, then Nsight Compute's memory tables per variant; the
# decode kernel with padded (swizzle 0) and swizzled (1) stages: order rows and the same ncu tables on b256 x 4096
# and the flat shared-pages case. Output: $OUT/s12a.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s12a
MET="--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section LaunchStats"
KEYS="gpu__time_duration.sum|dram__bytes_read.sum |lts__t_requests_srcunit_tex_op_read.sum |lts__t_sectors_srcunit_tex_op_read.sum |lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum |l1tex__data_bank_conflicts_pipe_lsu_mem_shared.*sum |lts__t_sectors_srcunit_ltcfabric.sum |smsp__inst_executed.sum "
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a dev/l2_stream.cu -o /tmp/l2s && /tmp/l2s | tee $R/l2s.log
gpu_time
timeout 120 ncu $MET -f -o $R/l2s /tmp/l2s once > $R/l2s_ncu.log 2>&1
ncu -i $R/l2s.ncu-rep --page raw > $R/l2s_raw.txt 2>&1; rm -f $R/l2s.ncu-rep
grep -E "stream<|$KEYS" $R/l2s_raw.txt | sed 's/  */ /g' | head -200
gpu_time
timeout 150 python3 dev/bench_shared_order.py '{"swizzle": 0}' '{"swizzle": 1}' > $R/order.log 2>&1; cat $R/order.log; gpu_time
for sw in 0 1; do for c in decode_b256 flat_shared; do
  DECODE_TUNING="{\"swizzle\": $sw}" timeout 60 ncu --profile-from-start off $MET -f -o $R/ncu_${c}_sw$sw python3 dev/profile_ncu.py $c > $R/ncu_${c}_sw$sw.log 2>&1
  ncu -i $R/ncu_${c}_sw$sw.ncu-rep --page raw > $R/ncu_${c}_sw${sw}_raw.txt 2>&1; rm -f $R/ncu_${c}_sw$sw.ncu-rep
  echo "== $c swizzle $sw"; grep -E "$KEYS" $R/ncu_${c}_sw${sw}_raw.txt | sed 's/  */ /g'
done; done
gpu_time
gpu_pack s12a
