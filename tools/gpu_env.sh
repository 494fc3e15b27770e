# Environment for running jitattn on a GPU machine without network access, from the repository root:
#   source tools/gpu_env.sh        (PEER=1 source tools/gpu_env.sh: FlashInfer's wheels too)
# Installs the wheels in .whl/ (and .whl/peer/ when PEER=1) into .pysite and points Python, the jitattn cache and
# FlashInfer's workspace at local paths; then defines the helpers below for a script of measurements.
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target .pysite "$@"; }
pip_target .whl/*.whl
if [ "${PEER:-0}" = 1 ] && ls .whl/peer/*.whl >/dev/null 2>&1; then pip_target .whl/peer/*.whl; fi
export PYTHONPATH=$PWD/.pysite:$PWD PYTHONUNBUFFERED=1 JITATTN_CACHE_DIR=/tmp/jc FLASHINFER_WORKSPACE_BASE=/tmp/fi
# Kernels built beforehand on a machine without a GPU (tools/prebuild_cache.py), when the archive is there.
if [ -f .whl/prebuilt.tar.xz ]; then mkdir -p "$JITATTN_CACHE_DIR" && tar xJf .whl/prebuilt.tar.xz -C "$JITATTN_CACHE_DIR"; fi
# gpu_begin NAME sets $OUT (where results are collected, /tmp/out by default), $R (/tmp/NAME, this script's
# results) and the start time; gpu_time prints the seconds since; gpu_pack NAME tars $R into $OUT/NAME.tgz, then the time.
gpu_begin() { OUT=${OUT:-/tmp/out}; R=/tmp/$1; mkdir -p "$OUT" "$R"; T0=$(date +%s); }
gpu_time() { echo "t=$(( $(date +%s) - T0 ))"; }
gpu_pack() { tar czf "$OUT/$1.tgz" -C /tmp "$1"; gpu_time; }
# gpu_manifests: the manifests of every kernel in the cache (what this run built or unpacked) into $R/manifests.tgz,
# for tools/prebuild_cache.py --manifests: the next run's archive then holds the kernels tests built one at a time.
gpu_manifests() { (cd "$JITATTN_CACHE_DIR" && find . -name manifest.json | tar czf "$R/manifests.tgz" -T -); }
# gpu_tree DIR: this checkout's jitattn, templates and tools copied to DIR (.pysite linked), for
# tools/bench_settings.py's TREE=DIR setting: change one line or template in DIR, then time it against this tree.
gpu_tree() { rm -rf "$1" && mkdir -p "$1" && cp -r jitattn templates tools "$1"/ && ln -s "$PWD/.pysite" "$1/.pysite"; }
# gpu_tests SECONDS PATH...: the GPU tests of PATHs into $R/pytest.log, its summary, the time.
gpu_tests() { local s=$1; shift; timeout "$s" python3 -m pytest -m gpu -q -p no:cacheprovider -rf "$@" > "$R/pytest.log" 2>&1
  tail -4 "$R/pytest.log"; gpu_time; }
# gpu_bench SECONDS ONLY: the suite's rows ONLY into $R/bench.json / bench.log, the rows, the time.
gpu_bench() { timeout "$1" python3 -m jitattn.bench --only "$2" --json "$R/bench.json" > "$R/bench.log" 2>&1
  grep -E "^[a-z0-9_]+/" "$R/bench.log" | cut -c1-125 | sort -u; gpu_time; }
# gpu_build_mla: the four MLA kernel specs (bf16, f16, fp8 e4m3 with bf16 q, fp8 e5m2 with f16 q) built in parallel.
gpu_build_mla() { python3 -c "
import concurrent.futures as cf, torch, jitattn.jit as jit
from jitattn.runtime.mla_kernel import kernel_spec
specs = [kernel_spec(torch.bfloat16), kernel_spec(torch.float16), kernel_spec(torch.bfloat16, torch.float8_e4m3fn),
         kernel_spec(torch.float16, torch.float8_e5m2)]
with cf.ThreadPoolExecutor(4) as ex: list(ex.map(jit.load, specs))
" 2>&1 | tail -3; gpu_time; }
# gpu_ncu SECONDS CASE...: Nsight Compute (--set full) of tools/profile_ncu.py's CASEs into $R/ncu_CASE.txt (details),
# _raw.txt (every metric) and _sass.csv (per-instruction samples: tools/ncu_stalls.py), the headline lines, the time;
# the reports themselves are removed (large).
# NCU_TAG=x names the files ncu_CASEx (two tunings of one case, e.g. with DECODE_TUNING set); a suite:NAME case's
# files take the name's last part (suite:variants/verify_custom_tree_b32_q64_s4160 -> ncu_verify_custom_tree_...).
gpu_ncu() { local s=$1; shift; local c n; for c in "$@"; do n="${c##*[:/]}${NCU_TAG:-}"
  timeout "$s" ncu --profile-from-start off --set full --import-source no -f -o "$R/ncu_$n" \
    python3 tools/profile_ncu.py "$c" > "$R/ncu_$n.log" 2>&1
  ncu -i "$R/ncu_$n.ncu-rep" --page details > "$R/ncu_$n.txt" 2>&1
  ncu -i "$R/ncu_$n.ncu-rep" --page raw > "$R/ncu_${n}_raw.txt" 2>&1
  ncu -i "$R/ncu_$n.ncu-rep" --page source --csv --print-source sass > "$R/ncu_${n}_sass.csv" 2>&1  # ncu_stalls.py
  grep -E "Duration|DRAM Throughput|L2 Hit Rate|Issued Ipc Active|Warp Cycles Per Issued|Registers Per|Grid Size" "$R/ncu_$n.txt" | head -12
  grep -E "pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active" "$R/ncu_${n}_raw.txt" | head -1
  rm -f "$R/ncu_$n.ncu-rep"; echo "$(gpu_time) $n"; done; }
