#!/usr/bin/env bash
# Session 10, call 2 (carry [".whl"]): per-block phase timeline of the decode kernel (dev/trace_decode.py:
# b1 x 32k, the cascade's tails alone, the skewed batch, b64 x 2048) and the SASS of the plain decode kernel.
# Output: $OUT/s10b.tgz.
set -u
source dev/gpu_env.sh
gpu_begin s10b
timeout 240 python3 dev/trace_decode.py > $R/trace.log 2>&1; cat $R/trace.log; gpu_time
so=$(ls /tmp/jc/*/*decode_paged_bf16_hd128_g4_nhd*/*.so 2>/dev/null | head -1); [ -z "$so" ] && so=$(find /tmp/jc -name "*.so" | grep decode | head -1)
echo "so=$so"; (cuobjdump -sass "$so" || /usr/local/cuda/bin/cuobjdump -sass "$so") > $R/decode.sass 2>&1; wc -l $R/decode.sass
gpu_pack s10b
