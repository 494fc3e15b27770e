"""Suite rows under several decode TUNING overrides, one subprocess each (a distinct rendered source per
tuning, so a distinct cache entry), printed side by side in microseconds, alternating the tunings twice.

    python3 tools/decode_tunings.py OUT.json '{}' '{"max_stages": 6}' ... [--only decode/a,decode/b]

Each row is the suite's own timing (``python -m jitattn.bench``: events, L2 evicted); the first tuning's
SDPA figure is printed beside the rows for scale.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

DEFAULT_ONLY = ("decode/llama8b_b256_s4096,decode/llama8b_b64_s2048,decode/llama8b_b1_s32768,"
                "decode/mha_b64_s2048_d128,decode/phi3_d96_b64_s4096,decode/skewed_b64,decode/fp8kv_b256_s4096")
CHILD = ("import json, sys; import jitattn.kernels.decode as d; d.TUNING.update(json.loads(sys.argv[1])); "
         "from jitattn.bench.__main__ import main; sys.exit(main(sys.argv[2:]))")


def run(tuning: str, only: str) -> dict[str, dict]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        done = subprocess.run([sys.executable, "-c", CHILD, tuning, "--only", only, "--measure-s", "0.3",
                               "--json", f.name], check=False, stdout=subprocess.DEVNULL)
        try:
            return {r["name"]: r for r in json.load(open(f.name))["rows"]}
        except (json.JSONDecodeError, KeyError):  # the child failed before writing rows: keep the others
            print(f"tuning {tuning}: no rows (exit {done.returncode})", file=sys.stderr)
            return {}


def main(argv: list[str]) -> None:
    only = DEFAULT_ONLY
    if "--only" in argv:
        i = argv.index("--only")
        only = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    out, tunings = argv[0], argv[1:]
    results: dict[str, list[dict]] = {t: [] for t in tunings}
    for _ in range(2):
        for t in tunings:
            results[t].append(run(t, only))
    names = list(dict.fromkeys(n for runs in results.values() for r in runs for n in r))
    print(f"{'case':40s} {'sdpa':>8s} " + " ".join(f"{t[:24]:>24s}" for t in tunings))
    for n in names:
        first = next((r[n] for r in results[tunings[0]] if n in r), {})
        sdpa = ((first.get("sdpa") or {}).get("default") or {}).get("time_us")
        cells = []
        for t in tunings:
            us = [r[n]["time_us"] for r in results[t] if n in r and r[n].get("time_us")]
            cells.append(" / ".join(f"{u:.1f}" for u in us))
        print(f"{n:40s} {sdpa or 0:8.1f} " + " ".join(f"{c:>24s}" for c in cells))
    json.dump(results, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
