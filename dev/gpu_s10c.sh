#!/usr/bin/env bash
# Session 10, call 3 (carry [".whl"]): the decode kernel with work units and lookahead (branch decode-lookahead):
# its GPU tests, the same-tuning rows of dev/bench_shared_order.py (compare with call 1's '{}'), the phase trace.
# Output: $OUT/s10c.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s10c
gpu_tests 300 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_api_cascade.py \
  tests/test_nan_query.py tests/test_batch_invariant.py tests/test_api_dropin.py tests/test_sinks.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
timeout 150 python3 dev/bench_shared_order.py '{}' > $R/order.log 2>&1; cat $R/order.log; gpu_time
timeout 100 python3 dev/trace_decode.py > $R/trace.log 2>&1; cat $R/trace.log; gpu_time
gpu_pack s10c
