#!/usr/bin/env bash
# Session 9, call 1 (carry [".whl"]): the MLA TMA kernel (paired blocks, one warpgroup's softmax under the other's
# GEMMs): build, a smoke run under a short timeout (a deadlock costs little), the MLA GPU tests, both load paths
# timed side by side, the suite's mla/* rows, the kernel's SASS summary. Output: $OUT/s9a.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s9a
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$R/gpu.txt"
python3 - <<'PY' 2>&1 | tail -5 | tee "$R/build.txt"
import concurrent.futures as cf, torch, jitattn.jit as jit
from jitattn.mla_kernel import kernel_spec
specs = [kernel_spec(torch.bfloat16), kernel_spec(torch.float16), kernel_spec(torch.bfloat16, torch.float8_e4m3fn),
         kernel_spec(torch.float16, torch.float8_e5m2)]
with cf.ThreadPoolExecutor(4) as ex:
    for m in ex.map(jit.load, specs): print("built", m.spec.uri)
PY
gpu_time
find /tmp/jc -name "*.so" -path "*mla_cuda_bf16_hd576*" | head -1 | xargs -I{} cuobjdump -sass {} > "$R/mla_bf16.sass" 2>&1
grep -c "HGMMA" "$R/mla_bf16.sass"; grep -E "^\s+Function" "$R/mla_bf16.sass"
export JITATTN_MLA_KERNEL=sm90-tma
timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/test_mla_kernel.py \
  -k "both_load_paths and tma and (decode or long_split_noncausal) and (64 or 16)" 2>&1 | tail -15 | tee "$R/smoke.txt"
gpu_time
unset JITATTN_MLA_KERNEL
gpu_tests 300 --maxfail=10 tests/test_mla_kernel.py
grep -E "FAILED|Error|assert" "$R/pytest.log" | head -30
timeout 120 python3 dev/mla_paths.py 2>&1 | tee "$R/paths.txt"
gpu_time
gpu_bench 100 'mla/*'
gpu_pack s9a
