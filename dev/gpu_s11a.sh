#!/usr/bin/env bash
# Session 11, call 1 (carry [".whl"], PEER=1): decode K/V rows by bulk copies (TUNING bulk_copy, default 1 in
# this tree). A canary (both copy paths against the reference), then bulk_copy 0 vs 1 beside FlashInfer on the
# shared / unshared rows, then the decode-side GPU files. Output: $OUT/s11a.tgz.
set -u
PEER=1 source dev/gpu_env.sh
gpu_begin s11a
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf -x tests/test_decode_cuda.py -k "copy_paths" > $R/canary.log 2>&1
tail -3 $R/canary.log; gpu_time
timeout 150 python3 dev/bench_shared_order.py '{"bulk_copy": 0}' '{"bulk_copy": 1}' --peer > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_tests 220 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_api_cascade.py \
  tests/test_nan_query.py tests/test_batch_invariant.py tests/test_api_dropin.py tests/test_sinks.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_pack s11a
