#!/usr/bin/env bash
# Session 10, call 5 (carry [".whl"]): the lookahead kernel with units from the work counter vs in a fixed order,
# run on branch decode-lookahead at ff558eb (reverted since: main has no static_units key, and
# bench_shared_order.py now refuses it).
set -u
source dev/gpu_env.sh
gpu_begin s10e
timeout 200 python3 dev/bench_shared_order.py '{}' '{"static_units": 1}' > $R/order.log 2>&1; cat $R/order.log; gpu_time
gpu_pack s10e
