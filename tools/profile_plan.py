"""Host time of decode plan() for b256 x 4096 (index arrays on the host), then its cProfile (top 25 by self time).

    python3 tools/profile_plan.py     # DEV=cpu: on a machine without a GPU
"""
import cProfile, pstats, time, torch, jitattn, os, sys
dev = os.environ.get("DEV", "cuda")
b, pages, ps = 256, 256, 16
indices = torch.randperm(b * pages + 64, dtype=torch.int64)[: b * pages].to(torch.int32)
indptr = (torch.arange(b + 1) * pages).to(torch.int32)
last = torch.full((b,), ps, dtype=torch.int32)
ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
dec = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
plan = lambda: dec.plan(indptr, indices, last, 32, 8, 128, ps, q_data_type=torch.bfloat16)
for _ in range(20): plan()
ts=[]
for _ in range(5):
    t=time.perf_counter()
    for _ in range(50): plan()
    ts.append((time.perf_counter()-t)/50*1e6)
print("plan us", sorted(ts))
pr=cProfile.Profile(); pr.enable()
for _ in range(200): plan()
pr.disable()
pstats.Stats(pr).sort_stats(os.environ.get("SORT", "tottime")).print_stats(25)
