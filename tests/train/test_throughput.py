"""Throughput accounting: datasheet peaks by GPU name, the measured CPU peak, tokens/s and MFU."""

from __future__ import annotations

import pytest
import torch

from ropelab.config import ModelConfig
from ropelab.model import Transformer
from ropelab.train import throughput
from ropelab.train.throughput import (PEAKS_ENV, Throughput, given_cpu_peak, gpu_spec, measured_cpu_peak, peak_bandwidth,
                                      peak_flops, peaks_environment)


@pytest.mark.parametrize("name, flops, bandwidth", [
    ("NVIDIA H100 80GB HBM3", 989e12, 3.35e12),
    ("NVIDIA H100 PCIe", 756e12, 2.0e12),
    ("NVIDIA H100 NVL", 835e12, 3.9e12),
    ("NVIDIA H200", 989e12, 4.8e12),
    ("NVIDIA A100-SXM4-80GB", 312e12, 2.039e12),
    ("NVIDIA A100 80GB PCIe", 312e12, 1.935e12),
    ("NVIDIA A100-SXM4-40GB", 312e12, 1.555e12),
    ("NVIDIA A10", 125e12, 600e9),
    ("NVIDIA L4", 121e12, 300e9),
    ("NVIDIA L40S", 362e12, 864e9),
    ("NVIDIA GeForce RTX 4090", 165e12, 1.008e12),
])
def test_datasheet_peaks_by_device_name(name, flops, bandwidth):
    spec = gpu_spec(name)
    assert (spec.bf16_flops, spec.bandwidth) == (flops, bandwidth)


@pytest.mark.parametrize("name", ["NVIDIA GeForce GTX 1080", "NVIDIA GH200 480GB", "Tesla V100-SXM2-16GB"])
def test_unknown_gpu_has_no_peak(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    flops, source = peak_flops("cuda")
    assert flops is None and name in source
    assert peak_bandwidth("cuda")[0] is None


def test_cuda_peak_comes_from_the_datasheet(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert peak_flops(torch.device("cuda"), torch.bfloat16) == (989e12, "NVIDIA datasheet, NVIDIA H200, bf16 dense")
    assert peak_bandwidth("cuda") == (4.8e12, "NVIDIA datasheet, NVIDIA H200")


def test_cpu_peak_is_measured_once(monkeypatch):
    first, source = peak_flops("cpu", torch.float32)
    assert first > 1e8 and "measured float32 matmul" in source
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: pytest.fail("measured twice"))
    assert peak_flops("cpu", torch.float32)[0] == first
    assert measured_cpu_peak(torch.float32, torch.get_num_threads()) == first


def test_a_peak_given_by_the_study_is_used_and_a_bad_one_measured(monkeypatch):
    given = peaks_environment({(torch.float32, 3): 1.25e11, (torch.bfloat16, 3): 2.5e11})
    monkeypatch.setenv(PEAKS_ENV, given[PEAKS_ENV])
    assert given_cpu_peak(torch.float32, 3) == 1.25e11 and given_cpu_peak(torch.bfloat16, 3) == 2.5e11
    assert given_cpu_peak(torch.float32, 2) is None  # measured for other threads: not this one's
    measured_cpu_peak.cache_clear()
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda dtype, threads: pytest.fail("measured"))
    assert measured_cpu_peak(torch.float32, 3) == 1.25e11
    for bad in ("float32/3=fast", "float32/3=-1", "float32/3=nan", "float32/3=inf", "float32/3"):
        monkeypatch.setenv(PEAKS_ENV, bad)
        assert given_cpu_peak(torch.float32, 3) is None
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda dtype, threads: 7e10)
    measured_cpu_peak.cache_clear()
    assert measured_cpu_peak(torch.float32, 3) == 7e10
    measured_cpu_peak.cache_clear()


def _model() -> Transformer:
    """1 layer, d_model 8, 2 heads of 4, d_ff 16, vocab 16, untied: weights counted by hand below."""
    return Transformer(ModelConfig(vocab_size=16, n_layer=1, d_model=8, n_head=2, d_ff=16, max_seq_len=64))


def test_flops_per_token_by_hand():
    # matrix products: q, k, v, o 4 x 8*8; SwiGLU 3 x 8*16; lm_head 16*8. Norms: 3 x 8 (counted in
    # N, as in the formula's N). The input embedding (16*8) is a lookup: left out.
    n = 4 * 64 + 3 * 128 + 128 + 3 * 8
    attention = 12 * 1 * 2 * 4 * 32  # 12 * layers * heads * head_dim * seq_len
    assert _model().flops_per_token(32) == 6 * n + attention


def test_throughput_window_and_mfu():
    tracker = Throughput(_model(), seq_len=32, tokens_per_step=64, device="cpu", window=2, peak=1e6)
    assert tracker.peak_source == "given"
    first = tracker.update(0.5)
    assert first["tokens_per_s"] == pytest.approx(128.0)
    tracker.update(1.0)
    third = tracker.update(3.0)  # the window holds the last two steps: 128 tokens in 4 s
    assert third["tokens_per_s"] == pytest.approx(32.0)
    flops_per_token = 6 * (4 * 64 + 3 * 128 + 128 + 3 * 8) + 12 * 2 * 4 * 32
    assert third["mfu"] == pytest.approx(flops_per_token * 32.0 / 1e6)


def test_no_mfu_without_a_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Unknown GPU")
    tracker = Throughput(_model(), seq_len=32, tokens_per_step=64, device="cuda")
    assert tracker.update(1.0) == {"tokens_per_s": 64.0, "mfu": None}


FLOPS_PER_TOKEN = 6 * (4 * 64 + 3 * 128 + 128 + 3 * 8) + 12 * 2 * 4 * 32  # _model() at seq_len 32


@pytest.mark.parametrize("remeasured, mfu, raised", [(4e6, 0.5, False), (1.5e6, 1.0, True)])
def test_a_step_beyond_the_measured_cpu_peak_never_reports_mfu_above_one(monkeypatch, remeasured, mfu, raised):
    """Before: a CPU peak timed while other work loaded the machine let later steps report MFU > 100%.
    Now the peak is timed again (once); a step still faster sets the peak itself."""
    monkeypatch.setattr(throughput, "peak_flops", lambda device, dtype: (1e6, "measured float32 matmul, 1 threads"))
    timings = []
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda dtype, threads: timings.append(dtype) or remeasured)
    tracker = Throughput(_model(), seq_len=32, tokens_per_step=64, device="cpu", window=1)
    seconds = 64 * FLOPS_PER_TOKEN / 2e6  # 2e6 FLOP/s: twice the first measurement
    assert tracker.update(seconds)["mfu"] == pytest.approx(mfu)
    assert tracker.update(seconds)["mfu"] == pytest.approx(mfu) and timings == [torch.float32]  # timed again once
    assert tracker.peak == pytest.approx(max(remeasured, 2e6))
    assert ("raised to a step's rate" in tracker.peak_source) == raised


def test_a_datasheet_or_given_peak_is_never_changed(monkeypatch):
    monkeypatch.setattr(throughput, "measure_cpu_peak", lambda dtype, threads: pytest.fail("timed again"))
    tracker = Throughput(_model(), seq_len=32, tokens_per_step=64, device="cpu", window=1, peak=1e6)
    assert tracker.update(64 * FLOPS_PER_TOKEN / 2e6)["mfu"] == pytest.approx(2.0) and tracker.peak == 1e6
