#!/usr/bin/env bash
# Session 8, call 4 (carry [".whl"], PEER=1): the one-pass in-kernel cascade merge: decode / cascade GPU tests,
# the decode and cascade suite rows, the cascade kernel profile, the host table beside FlashInfer. Output: $OUT/s8d.tgz.
set -u
PEER=1 source dev/gpu_env.sh
gpu_begin s8d
gpu_tests 150 tests/test_decode_cuda.py tests/test_api_cascade.py tests/test_api_decode.py
gpu_bench 100 'decode/llama8b_b64_s2048,decode/llama8b_b256_s4096,decode/llama8b_b1_s32768,decode/skewed_b64,decode/llama8b_b64_s2048_rope,cascade/*'
timeout 30 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
gpu_time
timeout 150 python3 -m jitattn.bench.host_peer $R/host.json > $R/host.log 2>&1; tail -9 $R/host.log
gpu_pack s8d
