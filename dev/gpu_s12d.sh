#!/usr/bin/env bash
# Session 12, call 4 (carry [".whl"]): the CUDA-core decode path's rows on a 128-byte aligned region; head_dim 256
# on the tensor-core path (TUNING mma_d256) against it, gemma-2 / phi3 shapes beside the llama8b rows; then the whole
# GPU suite. Output: $OUT/s12d.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s12d
timeout 200 python3 dev/bench_shared_order.py '{}' '{"mma_d256": 1}' --shapes > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_tests 380 tests
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_pack s12d
