#!/usr/bin/env bash
# Session 12, call 5 (carry [".whl"]): head_dim 256 on the tensor-core path by default (mma_d256 1): the decode-side
# GPU files; order rows with the other head shapes for two more decode tile layouts (gpt-oss d64 ran at 0.81x SDPA);
# the suite's gemma-2, gpt-oss and cascade rows (SDPA beside). Output: $OUT/s12e.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s12e
gpu_tests 150 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_api_cascade.py \
  tests/test_nan_query.py tests/test_batch_invariant.py tests/test_sinks.py tests/test_api_dropin.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
timeout 100 python3 dev/bench_shared_order.py '{}' '{"mma_steps": 2}' '{"max_stages": 6}' --shapes > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_bench 50 'decode/gemma2_softcap_b64_s4096_d256,decode/gptoss_b64_s8192,decode/llama8b_b256_s4096,cascade'
gpu_pack s12e
