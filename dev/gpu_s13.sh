#!/usr/bin/env bash
# Written in session 13, which had no device time (the work's 30 minutes were spent: 199 s left, "cannot start
# another"); for the next session's first call (carry [".whl"], PEER=1, ~420 s):
#  1. TUNING mma_d256 = 1 in this device copy only (sed below; main keeps 0 until this passes): the decode GPU
#     file, the API decode and NaN files (their head_dim 256 cases, never run on a GPU yet), then gemma-2's row.
#  2. The decode rows still behind SDPA, per TUNING (dev/bench_shared_order.py --shapes, FlashInfer beside):
#     gpt-oss d64 runs 16 KiB stages (64 tokens x 64 dims x K+V) where d128 runs 32 KiB, so its per-stage
#     costs (barrier, softmax, page lookups) weigh twice per byte and only 2 x 3 x 16 KiB are in flight per SM;
#     mma_steps 2 doubles the stage, max_stages 6 the bytes in flight. Predicted: d64 302 -> ~250 us (SDPA 244);
#     b1 x 32k and the skewed batch gain from deeper stages if they are latency-bound (42.2 / 71.0 us now).
# Output: $OUT/s13.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s13
sed -i 's/"mma_d256": 0,/"mma_d256": 1,/' jitattn/families/decode.py
grep -n '"mma_d256"' jitattn/families/decode.py
gpu_tests 150 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_nan_query.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_bench 40 'decode/gemma2_softcap_b64_s4096_d256'
sed -i 's/"mma_d256": 1,/"mma_d256": 0,/' jitattn/families/decode.py
timeout 220 python3 dev/bench_shared_order.py '{}' '{"mma_steps": 2}' '{"max_stages": 6}' \
  '{"mma_steps": 2, "max_stages": 3}' --shapes --peer > "$R/order.log" 2>&1
tail -40 "$R/order.log"
gpu_pack s13
