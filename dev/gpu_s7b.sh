#!/usr/bin/env bash
# Session 7, call 4 (carry [".whl"]): the cascade shared level's prefill kernel per chunk size (its one-wave
# split of 4 chunks ran slower than 9 chunks over 3 rounds), and ncu of that kernel at 4 and 9 chunks.
set -u
source dev/gpu_env.sh
gpu_begin s7b
timeout 120 python3 dev/profile_cascade.py --sweep > $R/sweep.txt 2>&1; cat $R/sweep.txt | grep -v USDT; gpu_time
for c in b128:128 b128:57; do
  timeout 70 ncu --kernel-name regex:jitattn_prefill --launch-skip 5 --launch-count 1 --set full --import-source no \
    -f -o $R/${c/:/_} python3 dev/profile_cascade.py --run $c > $R/ncu_${c/:/_}.log 2>&1
  ncu -i $R/${c/:/_}.ncu-rep --page details > $R/${c/:/_}.txt 2>&1
  ncu -i $R/${c/:/_}.ncu-rep --page source --csv --print-source sass > $R/${c/:/_}.sass.csv 2>&1
  grep -E "Duration|DRAM Throughput|Executed Ipc A|L2 Hit Rate|Grid Size" $R/${c/:/_}.txt | head -6
done
rm -f $R/*.ncu-rep; gpu_pack s7b
