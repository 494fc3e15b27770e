#!/usr/bin/env bash
# Session 12, call 3 (carry [".whl"]): after the swizzled decode stages -- the suite's decode, cascade and decode
# variant rows (SDPA beside); the order rows for two decode layouts beside FlashInfer (PEER=1).
# Output: $OUT/s12c.tgz.
set -u
PEER=1 source dev/gpu_env.sh
gpu_begin s12c
gpu_bench 330 'decode,cascade,variants/plain_decode_b64_s4096,variants/decode_*'
timeout 200 python3 dev/bench_shared_order.py '{}' '{"mma_blocks_per_sm": 3}' --peer > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_pack s12c
