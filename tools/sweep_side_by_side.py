"""The ops suite's mixed cases (POD, BatchAttention) against the prefill part's grid cap
(``jitattn.runtime.side_by_side``): each case's parts alone, then the one call with the cap the estimate picks
and with fixed caps. Timed as the suite times (``jitattn.bench.timing.Timer``: CUDA events, L2 evicted).

    python3 tools/sweep_side_by_side.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

import jitattn
from jitattn.bench import ops_mixed
from jitattn.bench.ops_cases import MIXED_CASES
from jitattn.bench.timing import Timer
from jitattn.runtime import side_by_side as sbs

CAPS = [132, 116, 100, 88, 76, 66, 56, 48, 40, 32, 24]


def main(out: str) -> None:
    device = torch.device("cuda")
    timer = Timer(device)
    estimate = sbs.prefill_sms
    results = {}
    for case in MIXED_CASES:
        data = ops_mixed.make_mixed_data(case, device)
        prefill = timer.measure(ops_mixed.prefill_call(jitattn, case, data, device)).median_us
        decode = timer.measure(ops_mixed.decode_call(jitattn, case, data, device)).median_us
        print(f"{case.name} prefill alone {prefill:.1f} decode alone {decode:.1f} sum {prefill + decode:.1f}",
              flush=True)
        row = {"prefill": prefill, "decode": decode}
        for cap in [None, *CAPS]:
            picked: list[int] = []
            sbs.prefill_sms = ((lambda f, b, s: picked.append(estimate(f, b, s)) or picked[-1]) if cap is None
                               else (lambda f, b, s, cap=cap: cap))
            t = timer.measure(ops_mixed.mixed_call(jitattn, case, data, device)).median_us
            name = f"estimate ({', '.join(map(str, sorted(set(picked))))})" if cap is None else str(cap)
            print(f"  cap {name}: {t:.1f} us ({(prefill + decode) / t:.3f}x the sum)", flush=True)
            row[name] = t
        sbs.prefill_sms = estimate
        results[case.name] = row
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
