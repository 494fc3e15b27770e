#!/usr/bin/env bash
# Session 10, calls 2 and 4 (carry [".whl"]): the decode kernel with work units and lookahead, run on branch
# decode-lookahead at d777f28 (v1, call 2) and ac55696 (v2, call 4) -- reverted since: on main this times the
# committed kernel. Its GPU tests, the rows of dev/bench_shared_order.py (compare with call 1's '{}'), the trace.
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
