"""benchmarks/gpu.py: its dry run (the same code on CPU with tiny shapes) and its exit without CUDA."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def gpu_benchmark(benchmark_script):
    return benchmark_script("gpu")


def test_dry_run_measures_every_figure(gpu_benchmark, capsys):
    assert gpu_benchmark.main(["--dry-run"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["benchmark"] == "gpu" and record["dry_run"] is True
    rope = record["rope"]
    assert set(rope) >= {"copy", "table@0.25", "none@0.25", "table@1", "none@1"}
    assert rope["table@0.25"]["rotary_dims"] == 16 and rope["none@1"]["rotary_dims"] == 64
    assert all(rope[key]["ms"] > 0 and rope[key]["share"] is None for key in ("copy", "table@1"))  # CPU: no datasheet
    train = record["train"]
    assert train["preset"] == "tiny-llama" and train["tokens_per_s"] > 0 and 0 < train["mfu"]
    assert train["tokens_per_s"] == pytest.approx(train["batch"] * train["seq"] / train["step_s"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real benchmark would run")
def test_exits_cleanly_without_cuda(gpu_benchmark, capsys):
    assert gpu_benchmark.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
