#!/usr/bin/env bash
# Session 9, call 3 (carry [".whl"]): the MLA TMA kernel with the rope chunks loaded first and wg1's P0 V0 first:
# the both-load-paths tests, both paths timed (also with L2-resident KV), the suite's mla/* rows. Output: $OUT/s9c.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s9c
python3 -c "
import concurrent.futures as cf, torch, jitattn.jit as jit
from jitattn.mla_kernel import kernel_spec
with cf.ThreadPoolExecutor(4) as ex: list(ex.map(jit.load, [kernel_spec(torch.bfloat16), kernel_spec(torch.float16)]))
" 2>&1 | tail -3
gpu_time
gpu_tests 200 --maxfail=10 tests/test_mla_kernel.py -k "both_load_paths or f16_and_separate or cuda_graphs or matches_the_reference"
grep -E "FAILED|Error" "$R/pytest.log" | head -20
timeout 150 python3 dev/mla_paths.py 2>&1 | tee "$R/paths.txt"
gpu_time
gpu_bench 100 'mla/*'
gpu_pack s9c
