"""benchmarks/gpu_check.py --dry-run: the GPU script's code path, on the Triton interpreter at toy sizes."""

import importlib
import re
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, run the script itself")
def test_dry_run_reports_every_section(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    gpu_check = importlib.import_module("gpu_check")
    out = tmp_path / "report.txt"
    gpu_check.main(["--dry-run", "--out", str(out)])
    report = out.read_text()
    assert re.search(r"\b[1-9]\d* passed", report) and "exit status 0" in report  # the kernel tests it runs
    sections = ("(a) copy bandwidth", "(b, c) decode attention", "(d) decode step", "(e) causal prefill", "(f) compiled",
                "(g) continuous batching", "(h) decode step launches", "(i) paged decode")
    for section in sections:
        assert f"## {section}" in report
    for method in ("ours e4m3 static", "ours e4m3 per-token-head", "SDPA float32", "QuantizedCache(fp8)"):
        assert method in report
    assert re.search(r"slope ratio ours / DynamicCache: -?\d+\.\d+", report)
    assert "ours e4m3 per-token-head host us/layer" in report  # the host side of a decode step, per layer
    launches = report.split("## (h) decode step launches")[1].split("\n## ")[0]
    # a timed line per launch: us, bytes read, GB/s, % of copy (write_settle: the write with outlier tokens)
    for launch in ("write", "attention", "reduce", "write_settle"):
        assert re.search(rf"^.*\b{launch}\b +\S+ +\d+\.\d +\d+\.\d{{3}} +\d+ +\d+%", launches, re.M), launch
    assert re.search(r"left-padded +4 +attention", launches)  # the left-padded step, at STAGES 4 too
    # and its splits merged by a reduce launch, against the attention launch's own merge
    assert re.search(r"left-padded +3, reduce launch +attention", launches)
    assert re.search(r"left-padded +3, reduce launch +reduce", launches)
    paged = report.split("## (i) paged decode")[1].split("\n## ")[0]  # one program per request, then 3 splits
    assert re.search(r"one program per request +2x2x1 +1 ", paged) and re.search(r"split rule +2x2x3 +2 ", paged)
    assert "FAILED" not in report
