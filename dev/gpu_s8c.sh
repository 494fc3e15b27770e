#!/usr/bin/env bash
# Session 8, call 3 (carry [".whl"], PEER=1): the whole GPU suite (sm90 dynamic items, RoPE tf32, the cascade's
# one-wave split and in-kernel merge), the decode / prefill / cascade suite rows, the cascade kernel profile, the
# host table beside FlashInfer. Output: $OUT/s8c.tgz.
set -u
PEER=1 source dev/gpu_env.sh
gpu_begin s8c
gpu_tests 300 tests
gpu_bench 170 'decode/llama8b_b64_s2048,decode/llama8b_b256_s4096,decode/llama8b_b1_s32768,decode/mha_b64_s2048_d128,decode/phi3_d96_b64_s4096,decode/skewed_b64,decode/fp8kv_b256_s4096,decode/gptoss_b64_s8192,decode/llama8b_b64_s2048_rope,decode/llama8b_b64_s2048_page1,variants/plain_decode_b64_s4096,variants/decode_rope_b64_s4096,prefill/llama8b_causal_b8_s4096,prefill/d64_causal_b16_s2048,prefill/d256_causal_b4_s4096,prefill/llama8b_noncausal_b8_s4096,prefill/llama8b_causal_paged_b8_s4096,prefill/llama8b_causal_varlen,cascade/*'
timeout 40 python3 dev/profile_cascade.py > $R/cascade.txt 2>&1; grep -E "^==|jitattn_" $R/cascade.txt | cut -c1-70,180-230
gpu_time
timeout 60 python3 -m jitattn.bench.host_peer > $R/host.txt 2>&1; head -8 $R/host.txt
gpu_pack s8c
