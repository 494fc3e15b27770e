"""``python -m jitattn.bench --baseline``: rows matched by name, compared by their fraction of the ceiling."""

from __future__ import annotations

import json

import pytest

from jitattn.bench import compare
from jitattn.bench.__main__ import main


def _row(name: str, fraction: float, time_us: float, status: str = "ok") -> dict:
    return {"name": name, "status": status, "fraction": fraction, "time_us": time_us}


BASELINE = {"created": "then", "rows": [_row("decode/a", 0.90, 100.0), _row("decode/b", 0.80, 50.0),
                                        _row("decode/c", 0.50, 10.0), _row("decode/gone", 0.9, 1.0),
                                        _row("decode/failed", 0.9, 1.0)]}
NOW = {"rows": [_row("decode/a", 0.60, 150.0), _row("decode/b", 0.81, 49.0), _row("decode/c", 0.60, 8.3),
                _row("decode/new", 0.7, 3.0), _row("decode/failed", None, None, status="error")]}


def test_changes_match_rows_by_name_and_skip_unmeasured_ones() -> None:
    got = {c.name: c for c in compare.changes(NOW, BASELINE)}
    assert sorted(got) == ["decode/a", "decode/b", "decode/c"]
    assert got["decode/a"].ratio == pytest.approx(0.60 / 0.90)
    assert got["decode/c"].time_before_us == 10.0 and got["decode/c"].time_after_us == 8.3


def test_report_lists_regressions_first_and_leaves_small_moves_out() -> None:
    text = compare.report(NOW, BASELINE, threshold=0.05)
    lines = text.splitlines()
    assert "3 rows in both, 1 slower and 1 faster" in lines[0]
    assert lines[1].split()[:2] == ["SLOWER", "decode/a"] and "0.90 -> 0.60" in lines[1]
    assert lines[2].split()[:2] == ["faster", "decode/c"]
    assert "decode/b" not in text  # 1.25% better: under the threshold


def test_load_rejects_what_is_not_a_results_file(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="no 'rows' list"):
        compare.load(str(bad))
    with pytest.raises(ValueError, match="cannot read"):
        compare.load(str(tmp_path / "missing.json"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BASELINE))
    assert compare.load(str(good))["created"] == "then"


def test_cli_fails_before_running_on_a_bad_baseline(tmp_path, capsys) -> None:
    assert main(["--only", "decode/llama8b_b64_s2048", "--baseline", str(tmp_path / "missing.json")]) == 2
    assert "--baseline" in capsys.readouterr().err


def test_runs_of_another_target_are_not_compared_and_odd_rows_are_left_out() -> None:
    """A cpu run beside an H200 one was reported all SLOWER (their shapes and units differ); a hand-edited row whose
    time is not a number crashed the report after the whole run."""
    gpu = {**BASELINE, "target": "cuda", "environment": {"device": "NVIDIA H200"}}
    cpu = {**NOW, "target": "cpu", "environment": {"device": "vm"}}
    assert compare.report(cpu, gpu) == ("beside the baseline (then): not compared: this run's target is cpu, the "
                                        "baseline's cuda (other shapes and units)")
    quick = {**cpu, "args": {"quick": True}}
    assert "one run is --quick" in compare.report(quick, {**BASELINE, "target": "cpu"})
    h100 = {**NOW, "target": "cuda", "environment": {"device": "NVIDIA H100"}}
    assert "(the baseline ran on NVIDIA H200, this run on NVIDIA H100" in compare.report(h100, gpu)
    odd = {"rows": [*BASELINE["rows"], {"name": "decode/x", "status": "ok", "fraction": 0.5, "time_us": "abc"},
                    {"name": "decode/y", "status": "ok", "fraction": True, "time_us": 3.0}]}
    assert sorted(c.name for c in compare.changes({"rows": odd["rows"]}, odd)) == \
        ["decode/a", "decode/b", "decode/c", "decode/failed", "decode/gone"]
