"""Benchmark rows: the run context, the row record, rates against the ceilings, the error metric."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .configs import Case
from .timing import Timer


SCHEMA = "jitattn-bench/1"
REF_REQUESTS = 2
REF_QUERIES = 128
TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
                "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class BudgetExceeded(Exception):
    pass


@dataclass
class Context:
    device: torch.device
    timer: Timer
    ceilings: dict
    measure_s: float
    case_budget_s: float
    deadline: float  # time.monotonic() after which no new case starts
    quick: bool = False
    failed_specs: dict = field(default_factory=dict)  # VariantSpec -> error text
    plain_rows: dict = field(default_factory=dict)  # name -> row: the variants' plain rows, the MLA twins
    case_deadline: float = math.inf
    peers: tuple[str, ...] = ()  # peer libraries timed beside jitattn (--peer)
    sdpa: bool = True  # time torch SDPA beside jitattn (--no-sdpa: off)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def target(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def time_left(self) -> float:
        return self.case_deadline - time.monotonic()

    def check_budget(self, stage: str) -> None:
        if self.time_left() <= 0:
            raise BudgetExceeded(f"case time budget ({self.case_budget_s:.0f} s) used up before {stage}")

    def sync(self) -> None:
        self.timer.sync()


# --------------------------------------------------------------------------- #
# Rows
# --------------------------------------------------------------------------- #
def new_row(case: Case, name: str | None = None) -> dict:
    return {
        "name": name or case.name, "suite": case.suite, "kind": case.kind, "status": "ok",
        "params": case.params(), "time_us": None, "timing": None,
        "bytes": getattr(case, "bytes", None), "flops": getattr(case, "flops", None),
        "rate": None, "rate_unit": None, "ceiling": getattr(case, "ceiling", None), "fraction": None,
        "sdpa": None, "sdpa_na": None, "baseline": None, "max_rel_err": None,
        "note": getattr(case, "note", "") or "", "error": None, "seconds": None,
    }


def rate_of(kind: str, nbytes: int | None, flops: int | None, time_us: float, ceilings: dict,
            against: str | None = None) -> tuple:
    """(rate, unit, ceiling name, fraction) of a bandwidth or compute row.

    Bandwidth rows are against ``read_stream`` unless ``against`` names another bandwidth ceiling (RoPE's
    ``copy``: it writes as much as it reads)."""
    if kind == "bandwidth" and nbytes:
        rate = nbytes / (time_us * 1e-6) / 1e9
        name = against or "read_stream"
        ceiling = ceilings.get(name, {}).get("gbps")
        return rate, "GB/s", name, (rate / ceiling if ceiling else None)
    if kind == "compute" and flops:
        rate = flops / (time_us * 1e-6) / 1e12
        ceiling = ceilings.get("gemm", {}).get("tflops")
        return rate, "TFLOP/s", "gemm", (rate / ceiling if ceiling else None)
    return None, None, None, None


def set_time(row: dict, timing, ctx: Context, fn=None) -> None:
    """Record ``timing`` (device time, launches hidden) and, on cuda, ``fn``'s plain-launch time beside it."""
    row["time_us"] = timing.median_us
    row["timing"] = timing.to_dict()
    if fn is not None and ctx.cuda:
        row["plain_launch_us"] = ctx.timer.plain_launch_us(fn)
    row["rate"], row["rate_unit"], row["ceiling"], row["fraction"] = rate_of(
        row["kind"], row["bytes"], row["flops"], timing.median_us, ctx.ceilings, row["ceiling"])


def join_notes(a: str, b: str) -> str:
    """Two notes of a row as one ("a; b"), either possibly empty."""
    return f"{a}; {b}" if a and b else (a or b)


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return error_summary(text) if text else type(exc).__name__


def error_summary(text: str, limit: int = 600) -> str:
    """An error's first lines joined (a refusal's "fix:" lines follow its first line), at most ``limit`` characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    joined = " / ".join(lines[:4])
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max |got - ref| / max |ref| over the slices (inf when got has NaN/inf)."""
    num, den = 0.0, 0.0
    for g, r in zip(got, ref):
        g64, r64 = g.to(torch.float64), r.to(device=g.device, dtype=torch.float64)
        if not bool(torch.isfinite(g64).all()):
            return math.inf
        num = max(num, float((g64 - r64).abs().max()))
        den = max(den, float(r64.abs().max()))
    return num / den if den > 0 else num


def cuda_ok() -> bool:
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False
