#!/usr/bin/env bash
# Session 11, last call (carry [".whl"]): the whole GPU suite on the final code (three consumer warpgroups and four
# stages at d64, the API checks); the d64 / d128 causal suite rows beside SDPA; Nsight Compute of FlashInfer's
# decode b256 x 4096 beside ours (same tables). Output: $OUT/s11e.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s11e
gpu_tests 370 tests
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_bench 50 'prefill/d64_causal_b16_s2048,prefill/llama8b_causal_b8_s4096'
pip_target .whl/peer/*.whl
gpu_ncu 45 fi_b256 decode_b256
for c in fi_b256 decode_b256; do
  grep -E "dram__throughput.avg.pct_of_peak_sustained_elapsed|launch__grid_size|launch__block_size|launch__registers_per_thread|launch__shared_mem_per_block_dynamic|sm__warps_active.avg.per_cycle_active|smsp__inst_executed.sum " "$R/ncu_${c}_raw.txt" | head -8
done
gpu_pack s11e
