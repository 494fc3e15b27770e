"""Child process for the cache tests: load one spec and report what happened.

    python tests/helpers/load_spec.py SPEC_JSON [--check] [--ready FILE --go FILE]

Prints one JSON line: the entry's path, the load time, this process's
``compile_count()`` and, with ``--check``, the largest error of merge_state /
merge_states against ``jitattn.reference`` (cpu merge specs only). With
``--ready/--go`` it touches READY after importing and waits for GO to appear,
so several children ask for the spec at the same moment.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def _merge_error(spec) -> float:
    import torch

    import jitattn
    from jitattn import reference

    dtype = spec.o_dtype.torch_dtype
    g = torch.Generator().manual_seed(os.getpid())
    v_a = torch.randn(5, 3, 40, generator=g).to(dtype)
    v_b = torch.randn(5, 3, 40, generator=g).to(dtype)
    s_a = torch.randn(5, 3, generator=g) * 3
    s_b = torch.randn(5, 3, generator=g) * 3
    v, s = jitattn.merge_state(v_a, s_a, v_b, s_b)
    v_ref, s_ref = reference.merge_state(v_a, s_a, v_b, s_b)
    err = max((v.float() - v_ref).abs().max().item(), (s - s_ref).abs().max().item())
    vs = torch.randn(5, 4, 3, 40, generator=g).to(dtype)
    ss = torch.randn(5, 4, 3, generator=g) * 3
    v, s = jitattn.merge_states(vs, ss)
    v_ref, s_ref = reference.merge_states(vs, ss)
    return max(err, (v.float() - v_ref).abs().max().item(), (s - s_ref).abs().max().item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec", help="VariantSpec.to_dict() as JSON")
    parser.add_argument("--check", action="store_true", help="run merge_state(s) against the reference")
    parser.add_argument("--ready", help="file to touch once imported")
    parser.add_argument("--go", help="file to wait for before loading")
    args = parser.parse_args()

    import jitattn
    import jitattn.jit
    from jitattn.spec import VariantSpec

    spec = VariantSpec.from_dict(json.loads(args.spec))
    if args.ready:
        Path(args.ready).touch()
    if args.go:
        deadline = time.monotonic() + 120
        while not os.path.exists(args.go):
            if time.monotonic() > deadline:
                raise SystemExit("timed out waiting for the go file")
            time.sleep(0.002)
    started = time.perf_counter()
    module = jitattn.load(spec)
    seconds = time.perf_counter() - started
    result = {
        "uri": spec.uri,
        "path": str(module.path),
        "entries": list(module.entry_names),
        "seconds": seconds,
        "compile_count": jitattn.jit.compile_count(),
    }
    if args.check:
        result["max_err"] = _merge_error(spec)
    # compile_count again: the check must not have built anything either.
    result["compile_count"] = jitattn.jit.compile_count()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
