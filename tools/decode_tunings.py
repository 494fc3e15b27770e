"""Suite rows under several decode TUNING overrides, one subprocess each (a distinct rendered source per
tuning, so a distinct cache entry), printed side by side in microseconds, alternating the tunings twice.

    python3 tools/decode_tunings.py OUT.json '{}' '{"max_stages": 6}' ... [--only decode/a,decode/b]
    python3 tools/decode_tunings.py OUT.json '{}' '{"kv_split.SHORT_ITEMS_MIN_BLOCKS_PER_SM": 3}'

Each row is the suite's own timing (``python -m jitattn.bench``: events, L2 evicted); the first tuning's
SDPA figure is printed beside the rows for scale.
"""

from __future__ import annotations

import sys

from bench_settings import compare

DEFAULT_ONLY = ("decode/llama8b_b256_s4096,decode/llama8b_b64_s2048,decode/llama8b_b1_s32768,"
                "decode/mha_b64_s2048_d128,decode/phi3_d96_b64_s4096,decode/skewed_b64,decode/fp8kv_b256_s4096")
# keys "kv_split.NAME" set the plan rule's constants (jitattn.kv_split.NAME, e.g. SHORT_ITEMS_MIN_BLOCKS_PER_SM);
# the others are decode TUNING entries
CHILD = ("import json, sys; import jitattn.kernels.decode as d, jitattn.kv_split as k; t = json.loads(sys.argv[1]); "
         "[setattr(k, n[9:], v) for n, v in t.items() if n.startswith('kv_split.')]; "
         "d.TUNING.update({n: v for n, v in t.items() if not n.startswith('kv_split.')}); "
         "from jitattn.bench.__main__ import main; sys.exit(main(sys.argv[2:]))")


def main(argv: list[str]) -> None:
    only = DEFAULT_ONLY
    if "--only" in argv:
        i = argv.index("--only")
        only = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    out, tunings = argv[0], argv[1:]
    commands = [[sys.executable, "-c", CHILD, t, "--only", only, "--measure-s", "0.3"] for t in tunings]
    compare(out, tunings, commands, [{}] * len(tunings), rounds=2)


if __name__ == "__main__":
    main(sys.argv[1:])
