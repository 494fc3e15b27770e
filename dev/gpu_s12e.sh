#!/usr/bin/env bash
# Session 12, call 5 (carry [".whl"]): head_dim 256 on the tensor-core path by default (mma_d256 1): the decode-side
# GPU files, then the suite's decode, cascade and decode-variant rows (SDPA beside). Output: $OUT/s12e.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s12e
gpu_tests 240 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_api_cascade.py \
  tests/test_nan_query.py tests/test_batch_invariant.py tests/test_sinks.py tests/test_api_dropin.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_bench 200 'decode,cascade,variants/plain_decode_b64_s4096,variants/decode_*'
gpu_pack s12e
