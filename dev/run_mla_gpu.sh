#!/bin/bash
# One GPU session for the sm90 MLA kernel: the gpu tests, the tuning timer, the benchmark's mla/* cases.
# Usage (on the H200): bash dev/run_mla_gpu.sh OUTDIR [tuning choices...]
out=${1:?outdir}; shift
export PYTHONPATH=$PWD JITATTN_CACHE_DIR=/tmp/jc_mla
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
t0=$(date +%s)
timeout 72 python3 -m pytest -q -m gpu --maxfail=8 -p no:cacheprovider tests/test_mla_kernel.py tests/test_mla.py \
  2>&1 | tail -40 > "$out/tests.txt"; echo "tests rc=$? after $(( $(date +%s) - t0 )) s" >> "$out/tests.txt"
cat "$out/tests.txt"
timeout 30 python3 dev/mla_tuning.py "$@" 2>&1 | tee "$out/tuning.txt"
echo "tuning after $(( $(date +%s) - t0 )) s"
timeout 38 python3 -m jitattn.bench --only 'mla/*' --json "$out/mla.json" 2>&1 | tail -25 | tee "$out/bench.txt"
echo "all after $(( $(date +%s) - t0 )) s"
