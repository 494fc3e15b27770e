#!/usr/bin/env bash
# Session 9, call 7 (carry [".whl"]): the gather MLA kernel with S of the next block behind P V of this one and the
# O rescale skipped when the max did not move: the MLA GPU tests, the tuning timer's shapes, the suite's mla/* rows.
# Output: $OUT/s9d.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s9d
gpu_build_mla
gpu_tests 240 --maxfail=10 tests/test_mla_kernel.py tests/test_mla.py
grep -E "FAILED|Error" "$R/pytest.log" | head -20
timeout 120 python3 dev/mla_tuning.py 128 2>&1 | tee "$R/tuning.txt"
gpu_time
gpu_bench 100 'mla/*'
gpu_pack s9d
