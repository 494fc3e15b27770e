#!/usr/bin/env bash
# Session 10, last call (carry [".whl"]): Nsight Compute of the sm90 prefill, dense causal d128 (b8 x 4096) and d64
# (b16 x 2048): tensor-pipe use and stall reasons for issue 17's notes; then those two suite rows (same run, beside
# SDPA). Output: $OUT/s10f.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s10f
for c in ragged ragged_d64; do
  timeout 90 ncu --profile-from-start off --set full --import-source no -f -o "$R/ncu_$c" \
    python3 dev/profile_ncu.py "$c" > "$R/ncu_$c.log" 2>&1
  ncu -i "$R/ncu_$c.ncu-rep" --page details > "$R/ncu_$c.txt" 2>&1
  ncu -i "$R/ncu_$c.ncu-rep" --page raw > "$R/ncu_${c}_raw.txt" 2>&1
  grep -E "Duration|SM Frequency|Issued Ipc Active|Warp Cycles Per Issued|Registers Per|Grid Size|Block Size" "$R/ncu_$c.txt" | head -12
  grep -E "pipe_tensor_op_hmma_cycles_active.avg.pct|pipe_tensor_cycles_active.avg.pct|sm__cycles_elapsed.avg " "$R/ncu_${c}_raw.txt" | head -4
  echo "$(gpu_time) $c"
done
rm -f $R/*.ncu-rep
gpu_bench 120 'prefill/llama8b_causal_b8_s4096,prefill/d64_causal_b16_s2048'
gpu_pack s10f
