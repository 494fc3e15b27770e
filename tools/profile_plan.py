"""Host time of plan() for b256 x 4096 (index arrays on the host), then its cProfile (top 25 by self time).

    python3 tools/profile_plan.py     # decode (page 16); DEV=cpu: on a machine without a GPU
    KIND=mla python3 tools/profile_plan.py     # the MLA wrapper at 128 heads, page 64 (the sm90 kernel on an H100/H200)
    SORT=cumulative ...                        # the profile's order (pstats' keys; default tottime)
"""
import cProfile, pstats, time, torch, jitattn, os, sys
if sys.argv[1:]:  # settings come from the environment: -h / --help (or anything else) prints them
    print(__doc__)
    sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
dev = os.environ.get("DEV", "cuda")
kind = os.environ.get("KIND", "decode")
sort = os.environ.get("SORT", "tottime")
if sort not in pstats.Stats.sort_arg_dict_default:
    raise SystemExit(f"SORT={sort!r}: give one of {', '.join(sorted(pstats.Stats.sort_arg_dict_default))}")
if kind not in ("decode", "mla"):
    raise SystemExit(f"KIND={kind!r}: give KIND=decode (the default) or KIND=mla")
if dev.startswith("cuda") and not torch.cuda.is_available():
    raise SystemExit("no CUDA device here: run it with DEV=cpu (the cpu target) or on a GPU machine")
b = 256
ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
if kind == "mla":
    pages, ps = 64, 64
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(ws)
    qo, lens = torch.arange(b + 1, dtype=torch.int32), torch.full((b,), pages * ps, dtype=torch.int32)
else:
    pages, ps = 256, 16
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    last = torch.full((b,), ps, dtype=torch.int32)
indices = torch.randperm(b * pages + 64, dtype=torch.int64)[: b * pages].to(torch.int32)
indptr = (torch.arange(b + 1) * pages).to(torch.int32)
if kind == "mla":
    plan = lambda: wrapper.plan(qo, indptr, indices, lens, 128, 512, 64, ps, False, 1 / 192 ** 0.5, torch.bfloat16,
                                torch.bfloat16)
else:
    plan = lambda: wrapper.plan(indptr, indices, last, 32, 8, 128, ps, q_data_type=torch.bfloat16)
for _ in range(20): plan()
ts=[]
for _ in range(5):
    t=time.perf_counter()
    for _ in range(50): plan()
    ts.append((time.perf_counter()-t)/50*1e6)
print(f"{kind} plan us", sorted(ts), getattr(wrapper, "kernel", ""))
pr=cProfile.Profile(); pr.enable()
for _ in range(200): plan()
pr.disable()
pstats.Stats(pr).sort_stats(sort).print_stats(25)
