#!/usr/bin/env bash
# Session 11, call 6 (carry [".whl"]): decode K / V stages with swizzled, unpadded rows (TUNING swizzle, default 1
# in this tree) against the padded pitch, on the shared / unshared rows (same run); then the decode-side GPU files.
# Output: $OUT/s11f.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s11f
timeout 100 python3 dev/bench_shared_order.py '{"swizzle": 0}' '{"swizzle": 1}' > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_tests 170 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_api_cascade.py \
  tests/test_nan_query.py tests/test_batch_invariant.py tests/test_sinks.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_pack s11f
