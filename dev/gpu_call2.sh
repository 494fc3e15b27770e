#!/usr/bin/env bash
# Session 6, second GPU call: the decode prologue / merge change (GPU tests, decode rows beside SDPA, the
# split sweep), then Nsight Compute reports (details, raw metrics, SASS source counters) of decode b1,
# paged / ragged sm90 prefill and MLA 128 heads, in one tarball. carry [".whl"].
set -u
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .pysite "$@"; }
pip_target .whl/*.whl
export PYTHONPATH=$PWD/.pysite:$PWD PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc FLASHINFER_WORKSPACE_BASE=/tmp/fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/ncu
T0=$(date +%s)
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_decode_cuda.py tests/test_api_decode.py \
  tests/test_api_cascade.py tests/test_batch_invariant.py tests/test_sinks.py tests/test_nan_query.py \
  > "$OUT/pytest.log" 2>&1; tail -6 "$OUT/pytest.log"; echo "t=$(( $(date +%s) - T0 ))"
timeout 100 python3 -m jitattn.bench --only 'decode/*' --json /tmp/ncu/bench_decode.json > /tmp/ncu/bench_decode.log 2>&1
grep -E "^decode/" /tmp/ncu/bench_decode.log | cut -c1-125 | sort -u; echo "t=$(( $(date +%s) - T0 ))"
timeout 60 python3 dev/sweep_decode_split.py > /tmp/ncu/split.txt 2>&1; cat /tmp/ncu/split.txt; echo "t=$(( $(date +%s) - T0 ))"
for c in decode_b1 paged16 ragged mla128; do
  timeout 100 ncu --profile-from-start off --set full --import-source no -f -o "/tmp/ncu/$c" \
    python3 dev/profile_ncu.py "$c" > "/tmp/ncu/$c.log" 2>&1
  ncu -i "/tmp/ncu/$c.ncu-rep" --page details > "/tmp/ncu/$c.txt" 2>&1
  ncu -i "/tmp/ncu/$c.ncu-rep" --page raw --csv > "/tmp/ncu/$c.raw.csv" 2>&1
  ncu -i "/tmp/ncu/$c.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu/$c.sass.csv" 2>&1
  grep -E "Duration|DRAM Throughput|Compute \(SM\) Th" "/tmp/ncu/$c.txt" | head -3; echo "t=$(( $(date +%s) - T0 )) $c"
done
rm -f /tmp/ncu/*.ncu-rep; tar czf "$OUT/call2.tgz" -C /tmp ncu; ls -la "$OUT"
