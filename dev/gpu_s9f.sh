#!/usr/bin/env bash
# Session 9, last call (carry [".whl"], PEER=1): the host-side plan() work (launch reuse, numpy page-table check and
# split): the GPU tests of every wrapper whose plan path changed, then the host table beside FlashInfer.
# Output: $OUT/s9f.tgz.
set -u
PEER=1 source dev/gpu_env.sh
gpu_begin s9f
gpu_tests 330 --maxfail=10 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_api_cascade.py \
  tests/test_api_prefill.py tests/test_api_dropin.py tests/test_batch_invariant.py tests/test_sinks.py \
  tests/test_nan_query.py tests/test_variants.py tests/test_backend_call_sequences_gpu.py tests/test_serving_gpu.py \
  tests/test_serving_engine_gpu.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
timeout 170 python3 -m jitattn.bench.host_peer $R/host.json > $R/host.log 2>&1; tail -12 $R/host.log
gpu_pack s9f
