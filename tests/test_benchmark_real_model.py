"""benchmarks/real_model.py --quick: 2 random layers of SmolLM2-135M's shape, tiny lengths; no model file needed.

Runs the script in this process (its memory measurements still run in subprocesses) and checks that the
JSON line holds every row for both libraries: tokens/s, peak memory, the GEMM floor of the training rows,
the ratios and the targets."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest
import torch

ROWS = ("forward2k", "forward8k", "train", "train-mlp", "train-full")  # train-*: ropelab with activation checkpointing
TRAIN_ROWS = ("train", "train-mlp", "train-full")
LIBRARIES = ("ropelab", "hf")
# The first training loss of each library, relative difference allowed. fp32: rounding of the same sums in
# another order. bf16 keeps 8 significant bits, so every activation and logit is off by up to a step of
# 2^-8 (~3.9e-3) relative, and the libraries round at different places (fused norm and projections, chunked
# cross-entropy): a mean over the batch's tokens moves by a few such steps, 1e-2. Seen on an AVX512-bf16 CPU:
# 5.34532 against 5.34196, 6.3e-4.
FIRST_LOSS_REL = {"fp32": 1e-4, "bf16": 1e-2}

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def real_model_benchmark(benchmark_script):
    return benchmark_script("real_model")


@pytest.fixture(scope="module")
def quick_record(real_model_benchmark):
    import transformers

    threads, verbosity = torch.get_num_threads(), transformers.logging.get_verbosity()
    progress = transformers.utils.logging.is_progress_bar_enabled()
    out = io.StringIO()
    try:
        # 1 thread: a smoke test of the machinery on a shared CPU, where 2-thread OpenMP regions stall
        with contextlib.redirect_stdout(out):
            assert real_model_benchmark.main(["--quick", "--reps", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
        transformers.logging.set_verbosity(verbosity)
        if progress:
            transformers.utils.logging.enable_progress_bar()
    lines = out.getvalue().strip().splitlines()
    assert "ropelab / HF:" in lines  # the table and the ratios came before the JSON line
    return json.loads(lines[-1])


def test_quick_run_measures_every_row_for_both_libraries(quick_record):
    record = quick_record
    assert record["benchmark"] == "real_model" and record["quick"] is True and record["layers"] == 2
    assert record["rows"] == list(ROWS) and "fp32" in record["precisions"]
    for precision in record["precisions"]:
        for row in ROWS:
            for library in LIBRARIES:
                r = record["results"][f"{precision}/{row}/{library}"]
                assert r["tokens_per_s"] > 0 and r["median_s"] > 0
                # the median is rounded to 0.1 ms and tokens/s to 0.1: tokens/s lies within both roundings
                tokens, median = r["batch"] * r["seq"], r["median_s"]
                assert tokens / (median + 5.1e-5) - 0.051 <= r["tokens_per_s"] <= tokens / (median - 5.1e-5) + 0.051
                assert r["added_mib"] > 0 and r["peak_mib"] > r["loaded_mib"] > 0
                assert r["peak_method"] == "VmHWM after clear_refs" or r["peak_method"].startswith("ru_maxrss")
            ratio = record["ratios"][f"{precision}/{row}"]
            assert ratio["speed"] > 0 and ratio["peak_memory"] > 0
            assert ratio["speed_min"] <= ratio["speed"] <= ratio["speed_max"]
            assert isinstance(record["targets"][f"{precision}/{row}/speed"]["met"], bool)
        for row in TRAIN_ROWS:
            assert isinstance(record["targets"][f"{precision}/{row}/peak_memory"]["met"], bool)
    assert record["all_targets_met"] == all(t["met"] for t in record["targets"].values())


def test_quick_run_measures_each_training_step_against_its_gemm_floor(quick_record, real_model_benchmark):
    """Structure only: each training row of each library has its profiled GEMM time (mm at least, only
    ops of GEMM_OPS) and its fused attention kernels' time, for each of --reps profiled steps, the median
    over those steps of each step's wall over the first and over both (after untimed steps until one
    pages in little memory), the same again from a process of its own, and ropelab's targets on both;
    forward rows have none."""
    record = quick_record
    assert {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm"} <= set(record["gemm_ops"])
    assert not set(record["gemm_ops"]) & set(record["attention_ops"])
    for precision in record["precisions"]:
        for row in ROWS:
            for library in LIBRARIES:
                r = record["results"][f"{precision}/{row}/{library}"]
                if row not in TRAIN_ROWS:
                    assert "gemm_s" not in r and "gemm_floor" not in r
                    continue
                assert "aten::mm" in r["gemm_ops"] and set(r["gemm_ops"]) <= set(record["gemm_ops"])
                assert all(op["calls"] > 0 and op["self_s"] >= 0 for op in r["gemm_ops"].values())
                assert r["gemm_s"] == pytest.approx(sum(op["self_s"] for op in r["gemm_ops"].values()), abs=1e-5)
                assert 0 < r["gemm_s"] <= r["profiled_s"]  # self times of one thread's ops within the step
                # the median step's figures, and the median over every profiled step of its wall over its products
                assert r["gemm_floor"] == pytest.approx(statistics.median(
                    step["profiled_s"] / step["gemm_s"] for step in r["floor_steps"]), rel=1e-3)
                assert len(r["floor_steps"]) == record["reps"]
                assert r["gemm_floor_range"][0] <= r["gemm_floor"] <= r["gemm_floor_range"][1]
                assert set(r["attention_ops"]) <= set(record["attention_ops"])
                assert r["attention_s"] == pytest.approx(sum(op["self_s"] for op in r["attention_ops"].values()),
                                                         abs=1e-5)
                assert r["product_floor"] == pytest.approx(statistics.median(
                    step["profiled_s"] / (step["gemm_s"] + step["attention_s"]) for step in r["floor_steps"]), rel=1e-3)
                # untimed steps until one paged in less than the threshold (or the most allowed), then the profiled
                settling = r["settling_paged_in_mib"]
                assert 1 <= len(settling) <= real_model_benchmark.MAX_SETTLING_STEPS
                assert all(mib >= real_model_benchmark.STEADY_PAGED_IN_MIB for mib in settling[:-1])
                assert len(settling) == real_model_benchmark.MAX_SETTLING_STEPS or (
                    settling[-1] < real_model_benchmark.STEADY_PAGED_IN_MIB)
                assert all(step["paged_in_mib"] >= 0 for step in r["floor_steps"])
                assert r["timed_product_floor"] == pytest.approx(r["median_s"] / (r["gemm_s"] + r["attention_s"]),
                                                                 rel=1e-3)
                # the same steps profiled again in the row's own memory subprocess
                own = r["own_process"]
                assert len(own["floor_steps"]) == record["reps"] and 0 < own["gemm_s"]
                assert 1 <= len(own["settling_paged_in_mib"]) <= real_model_benchmark.MAX_SETTLING_STEPS
                for floor in ("gemm_floor", "product_floor"):
                    assert own[f"{floor}_range"][0] <= own[floor] <= own[f"{floor}_range"][1]
                assert own["product_floor"] == pytest.approx(statistics.median(
                    step["profiled_s"] / (step["gemm_s"] + step["attention_s"]) for step in own["floor_steps"]), rel=1e-3)
            for floor in ("gemm_floor", "product_floor"):
                for label, figures in ((floor, lambda r: r), (f"own_process_{floor}", lambda r: r["own_process"])):
                    target = record["targets"].get(f"{precision}/{row}/{label}")
                    assert (target is not None) == (row in TRAIN_ROWS)
                    if target is not None:
                        assert target["target"] == "<= 1.1" and isinstance(target["met"], bool)
                        assert target["value"] == figures(record["results"][f"{precision}/{row}/ropelab"])[floor]


def test_quick_run_compares_the_same_model(quick_record):
    # same weights: the same logits, and the same first training loss on the same targets
    assert quick_record["check_logits_max_abs_diff"] < 1e-4
    assert quick_record["first_losses"]
    for key, pair in quick_record["first_losses"].items():
        precision = key.split("/")[0]
        assert pair["ropelab"] == pytest.approx(pair["hf"], rel=FIRST_LOSS_REL[precision]), key
    # every training row starts from the loaded weights: a library's first loss is the same in each of its rows
    # (activation checkpointing changes what backward recomputes, not the forward's loss)
    for precision in quick_record["precisions"]:
        for library in LIBRARIES:
            firsts = {quick_record["first_losses"][f"{precision}/{row}"][library] for row in TRAIN_ROWS}
            assert len(firsts) == 1, (precision, library, firsts)


def test_quick_run_reports_the_cpu_and_bf16(quick_record):
    cpu = quick_record["cpu"]
    assert isinstance(quick_record["reuse_freed_memory"], bool)
    assert cpu["model_name"] and set(cpu["flags"]) >= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert len(quick_record["loadavg"]["start"]) == 3
    # bf16 is either measured (native bf16) or reported as not measured, with the reason
    assert ("bf16" in quick_record["precisions"]) != ("bf16" in quick_record["not_measured"])
    assert ("bf16" in quick_record["precisions"]) == cpu["native_bf16"]
