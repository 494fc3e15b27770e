#!/usr/bin/env bash
# Head_dim 256 on the decode tensor-core path (carry [".whl"]): set jitattn.families.decode.TUNING["mma_d256"] to 1
# in the tree (and re-record tests/data/render_hashes.json), then run this: the decode GPU file, the API decode
# and NaN files (their head_dim 256 cases), then the suite's gemma-2 row. Written in session 12, whose device budget
# ran out before it could run. Output: $OUT/s12e.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s12e
gpu_tests 140 --maxfail=8 tests/test_decode_cuda.py tests/test_api_decode.py tests/test_nan_query.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
gpu_bench 40 'decode/gemma2_softcap_b64_s4096_d256'
gpu_pack s12e
