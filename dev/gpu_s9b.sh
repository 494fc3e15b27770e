#!/usr/bin/env bash
# Session 9, call 2 (carry [".whl"]): Nsight Compute of the MLA kernels (TMA and gathers) at 128 and 16 heads: the
# details page and the per-instruction stall samples of the top SASS lines. Output: $OUT/s9b.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s9b
for c in mla128 mla16; do
  for loads in sm90-tma sm90-gather; do
    n=${c}_${loads}
    JITATTN_MLA_KERNEL=$loads timeout 150 ncu --profile-from-start off --set full --import-source no -k regex:jitattn_mla \
      -f -o "$R/$n" python3 dev/profile_ncu.py "$c" > "$R/$n.log" 2>&1
    ncu -i "$R/$n.ncu-rep" --page details > "$R/$n.txt" 2>&1
    ncu -i "$R/$n.ncu-rep" --page source --csv --print-source sass > "$R/$n.src.csv" 2>&1
    grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Issue Slots Busy|Shared Memory|L2 Hit|Tensor" "$R/$n.txt" | head -20
    echo "$(gpu_time) $n"
  done
done
rm -f "$R"/*.ncu-rep  # the text pages come back; the reports are too large
gpu_pack s9b
