#!/usr/bin/env bash
# Session 9, call 8 (carry [".whl"]): the MLA kernel's overlap schedule (32-token blocks, 4 stages, the next block's
# softmax under P V): the MLA GPU tests, the tuning timer (overlap vs the serial schedule), the suite's mla/* rows.
# Output: $OUT/s9e.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s9e
gpu_build_mla
gpu_tests 240 --maxfail=10 tests/test_mla_kernel.py tests/test_mla.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
timeout 150 python3 dev/mla_tuning.py overlap=1 overlap=0 2>&1 | grep -v "prefill kernels" | tee "$R/tuning.txt"
gpu_time
gpu_bench 100 'mla/*'
gpu_pack s9e
