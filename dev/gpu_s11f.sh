#!/usr/bin/env bash
# Session 11, call 6 (carry [".whl"]): decode K / V stages with swizzled, unpadded rows (TUNING swizzle, default 1
# in this tree) against the padded pitch, on the shared / unshared rows (same run); then the decode GPU file and
# the cascade one. Logs straight into $OUT (a short device budget: whatever ran comes back).
set -u
source dev/gpu_env.sh
gpu_begin s11f
timeout 70 python3 dev/bench_shared_order.py '{"swizzle": 0}' '{"swizzle": 1}' > $OUT/order.log 2>&1; cat $OUT/order.log; gpu_time
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --maxfail=8 tests/test_decode_cuda.py \
  tests/test_api_cascade.py > $OUT/pytest.log 2>&1
tail -4 $OUT/pytest.log; grep -E "FAILED|Error" $OUT/pytest.log | head -20; gpu_time
