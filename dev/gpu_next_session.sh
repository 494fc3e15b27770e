#!/usr/bin/env bash
# The first GPU call of the session after session 6 (~550 s, carry [".whl"]): the whole GPU suite on main (three
# changes after session 6's last suite run: page_ids 0 compiling, the one-wave split rule narrowed,
# fast_decode_plan's launch kept across steps), then the
# open questions of session 6's notes: why the unsplit decode rows trail SDPA (cuDNN) by 7-10% (ncu of decode
# b256 beside SDPA's kernels on the same shapes), phi-3 d96 (+3% since the page ids moved to shared memory), the
# decode layout at 3 blocks per SM, and the host rows beside FlashInfer (fast_decode_plan's reused launch).
# Output: $OUT/next.tgz (pytest log, ncu details and SASS source counters per case).
set -u
PEER=1 source dev/gpu_env.sh
gpu_begin next
timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests > $R/pytest.log 2>&1; tail -4 $R/pytest.log
gpu_time
for c in decode_b256 sdpa_b256 phi3; do
  timeout 60 ncu --profile-from-start off --set full --import-source no -f -o $R/$c python3 dev/profile_ncu.py $c > $R/ncu_$c.log 2>&1
  ncu -i $R/$c.ncu-rep --page details > $R/$c.txt 2>&1
  ncu -i $R/$c.ncu-rep --page source --csv --print-source sass > $R/$c.sass.csv 2>&1
  grep -E "^  [a-zA-Z_<]|Duration|DRAM Throughput|Executed Ipc A|Registers Per" $R/$c.txt | cut -c1-120 | head -12
done
# Three resident blocks per SM now fit the registers (163 at 2 blocks, 170 the cap at 3): 12 warps per SM for
# the latency-bound unsplit rows, at 2 stages a block (75.8 KB each) instead of 3.
for t in '{}' '{"mma_blocks_per_sm": 3}'; do
  echo "tuning $t"; timeout 60 python3 -m jitattn.bench.decode_cuda --tuning "$t" 2>&1 | grep -E "^layout|jitattn decode" | cut -c1-160
done > $R/decode_tunings.txt 2>&1; grep -v "^layout" $R/decode_tunings.txt
timeout 120 python3 -m jitattn.bench.host_peer $R/host.json > $R/host.log 2>&1; tail -8 $R/host.log
rm -f $R/*.ncu-rep; gpu_pack next
