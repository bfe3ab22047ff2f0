"""benchmarks/rope.py and benchmarks/train.py run from one command and end with one JSON line of
their figures (tiny shapes here; the timings themselves are not asserted: see BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from ropelab.rope import cpu_kernel as rope_cpu

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rope_benchmark_times_every_method_and_reports_the_target_ratios():
    record = _run("rope.py", "--heads", "4", "--kv-heads", "2", "--seq", "64", "--reps", "3", "--warmup", "1",
                  "--threads", "1", "--fractions", "0.1", "0.25", "--keep-pairs", "32", "4")
    assert record["shape_q"] == [1, 4, 64, 64] and record["cpu_kernel"] == rope_cpu.available()
    methods = {"hf_neox@0.25", "hf_llama@1.0", "ropelab@0.1", "ropelab_torch@0.25", "ropelab_ref@1.0", "copy",
               "plan_shared@4", "plan_shared_torch@32", "plan_per_head@4", "plan_per_head@32"}
    if rope_cpu.available():  # the memory floor is compiled with the same compiler as the kernel
        methods |= {"touch@0.1", "touch@1.0"}
    assert methods <= set(record["ms"])
    assert all(times["fwd"] > 0 and times["fwd_bwd"] >= times["fwd"] for times in record["ms"].values())
    ratios = record["ratios"]
    for key in ("hf_neox_over_ropelab_at_0.25", "ropelab_full_over_copy", "ropelab_0.1_over_full",
                "plan_shared_4_over_full", "plan_per_head_4_over_full", "plan_per_head_32_over_shared",
                "plan_per_head_4_over_shared_torch"):
        assert ratios[key] is not None and math.isfinite(ratios[key]) and ratios[key] > 0
    # shared plans take the table path (64 positions x r pairs, cos + sin, fp32), per-head plans hold no table
    plans = record["plans"]
    assert plans["plan_shared@4"] == plans["plan_shared_torch@4"] == {"per_head": False, "table_bytes": 2 * 64 * 4 * 4}
    assert plans["plan_per_head@4"] == plans["plan_per_head@32"] == {"per_head": True, "table_bytes": 0}


def test_train_benchmark_compares_with_hf_and_reports_mfu():
    record = _run("train.py", "--shapes", "tiny-llama", "--precisions", "fp32", "--batch", "1", "--seq", "32",
                  "--steps", "1", "--warmup", "0", "--threads", "1", "--fractions")
    results = record["results"]
    assert {"tiny-llama/fp32/ropelab", "tiny-llama/fp32/hf_llama"} <= set(results)
    for result in results.values():
        assert result["tokens_per_s"] > 0 and 0 < result["mfu"]
    assert record["ratios"]["tiny-llama/fp32"] > 0


def test_tiny_shapes_benchmark_reports_every_setting_per_round():
    record = _run("tiny_shapes.py", "--steps", "22", "--rounds", "1", "--settings", "train.micro_batch=2",
                  "train.micro_batch=2 train.grad_accum=2")
    (round_results,) = record["rounds"]
    assert [r["setting"] for r in round_results] == ["train.micro_batch=2", "train.micro_batch=2 train.grad_accum=2"]
    assert all(r["tokens_per_s"] > 0 and r["wall_s"] > 0 for r in round_results)


def test_attention_benchmark_times_causal_against_unmasked_and_windows_against_full():
    record = _run("attention.py", "--causal-cost", "64", "128", "--causal-tokens", "256", "--reps", "2",
                  "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--threads", "1")
    assert record["benchmark"] == "attention_causal_cost" and record["batches"] == {"64": 4, "128": 2}
    assert set(record["median_s"]) == {"causal@64", "full@64", "causal@128", "full@128"}
    assert all(r > 0 and math.isfinite(r) for r in record["causal_over_full"].values())
    assert record["cpu"]["model_name"] and "native_bf16" in record["cpu"]
    record = _run("attention.py", "--windows", "16", "--window-tokens", "64", "--reps", "1", "--dense-reps", "1",
                  "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--threads", "1")
    assert record["benchmark"] == "attention_windows" and set(record["over_full"]) == {"full", "auto@16", "masked@16"}


def test_attention_benchmark_splits_the_fused_kernel_into_its_products_and_its_softmax():
    record = _run("attention.py", "--products", "32", "--causal-tokens", "64", "--reps", "1",
                  "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--threads", "1")
    assert record["benchmark"] == "attention_kernel_parts" and record["batch"] == 2 and record["tokens"] == 32
    # bf16 only where the CPU multiplies it natively: elsewhere its emulated kernels would be timed
    dtypes = ["float32"] + (["bfloat16"] if record["cpu"]["native_bf16"] else [])
    assert list(record["products_over_kernel"]) == dtypes
    assert set(record["median_s"]) == {f"{part}/{d}" for part in ("kernel", "products", "softmax") for d in dtypes}
    assert all(t > 0 and math.isfinite(t) for t in record["median_s"].values())


def test_stacked_benchmark_compares_a_stack_with_its_members_trained_alone():
    record = _run("stacked.py", "--members", "2", "--steps", "4", "--warmup", "1", "--seq", "32", "--micro-batches", "1")
    (result,) = record["results"]
    assert result["members"] == 2 and result["micro_batch"] == 1
    assert result["stacked_step_ms"] > 0 and result["eager_step_ms"] > 0 and result["speedup"] > 0
