#!/usr/bin/env bash
# Session 7's GPU calls (carry [".whl"]); output $OUT/s7.tgz.
# Call 3: the decode K/V copies zero-fill padding rows by cp.async's ignore-src predicate (no source-size
# arithmetic: ~200 -> ~80 instructions per 64-token tile for the copies) and take ex2.approx.ftz; the cascade
# shared level fills one wave. GPU tests of decode / cascade / split files, compute-sanitizer memcheck of the
# decode padding cases, the cascade kernels (torch.profiler), the decode and cascade suite rows.
set -u
source dev/gpu_env.sh
gpu_begin s7
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_decode_cuda.py tests/test_api_decode.py \
  tests/test_api_cascade.py tests/test_batch_invariant.py tests/test_sinks.py tests/test_nan_query.py \
  tests/test_page_table_and_kv_split.py > $R/pytest.log 2>&1; tail -3 $R/pytest.log; gpu_time
timeout 90 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -m gpu -q -p no:cacheprovider -x \
  tests/test_decode_cuda.py -k "layouts_page_sizes or sliding_window or split_matches or many_requests or empty_batch" \
  > $R/memcheck.log 2>&1; grep -E "ERROR SUMMARY|passed|failed" $R/memcheck.log | tail -3; gpu_time
timeout 60 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
gpu_time
timeout 200 python3 -m jitattn.bench --only 'decode/llama8b_b64_s2048,decode/llama8b_b256_s4096,decode/llama8b_b1_s32768,decode/mha_b64_s2048_d128,decode/phi3_d96_b64_s4096,decode/skewed_b64,decode/fp8kv_b256_s4096,decode/gptoss_b64_s8192,decode/llama8b_b64_s2048_rope,decode/llama8b_b64_s2048_page1,cascade/*' \
  --json $R/bench.json > $R/bench.log 2>&1
grep -E "^(decode|cascade)/" $R/bench.log | cut -c1-125 | sort -u; gpu_time
gpu_pack s7
