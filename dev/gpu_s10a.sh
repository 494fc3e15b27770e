#!/usr/bin/env bash
# Session 10, call 1 (carry [".whl"], PEER=1): flat decode over shared pages by block order (head-minor vs
# head-major) beside FlashInfer; Nsight Compute of decode b1 x 32k (one-wave split) and of the flat shared
# row. Output: $OUT/s10a.tgz.
set -u
PEER=1 source dev/gpu_env.sh
gpu_begin s10a
timeout 300 python3 dev/bench_shared_order.py '{}' '{"head_minor": 0}' '{"mma_warps": 8, "mma_blocks_per_sm": 1}' '{"mma_blocks_per_sm": 3, "page_ids": 256}' --peer > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_ncu 100 decode_b1 flat_shared
for t in '{}' '{"mma_warps": 8, "mma_blocks_per_sm": 1}'; do
  echo "tuning $t"; timeout 90 python3 -m jitattn.bench.decode_cuda --ceiling 4268 --tuning "$t" 2>&1 | grep -v "^layout" | tail -9
done; gpu_time
gpu_pack s10a
