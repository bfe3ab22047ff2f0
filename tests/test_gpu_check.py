"""benchmarks/gpu_check.py: its dry run on CPU (every stage reported, the figures each should have),
its CUDA-test stage on CPU, one stage's failure or timeout not stopping the others, the SmolLM2 shape."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
import torch

from ropelab.model import Transformer, count_params_meta

no_cuda_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the stages would run for real")


@pytest.fixture(scope="module")
def gpu_check(benchmark_script):
    return benchmark_script("gpu_check")


@pytest.fixture(scope="module")
def dry_run(gpu_check, tmp_path_factory):
    """(exit status, the printed lines, the JSON record they end with, the output folder) of one dry run."""
    out = tmp_path_factory.mktemp("gpu_check")
    printed = io.StringIO()  # module-scoped: capsys is function-scoped
    with contextlib.redirect_stdout(printed):
        code = gpu_check.main(["--dry-run", "--out", str(out)])
    lines = printed.getvalue().splitlines()
    return code, lines, json.loads(lines[-1]), out


@no_cuda_only
def test_dry_run_reports_every_stage(dry_run):
    code, lines, record, out = dry_run
    assert code == 0 and record["benchmark"] == "gpu_check" and record["dry_run"] is True
    assert record["ok"] is True and record["failed"] == []
    assert list(record["stages"]) == ["cuda_tests", "gpu", "smollm2"]
    assert record["stages"]["cuda_tests"] == {"status": "skipped: no CUDA"}
    assert all(record["stages"][name]["status"] == "ok" for name in ("gpu", "smollm2"))
    assert json.loads((out / "gpu_check.json").read_text()) == record
    assert {"gpu.log", "gpu.json", "smollm2.log"} <= {p.name for p in out.iterdir()}
    table = {line.split()[0]: line for line in lines if line.split()[:1] in (["cuda_tests"], ["gpu"], ["smollm2"])}
    assert "skipped: no CUDA" in table["cuda_tests"] and "tokens/s" in table["gpu"] and "4x16: " in table["smollm2"]


@no_cuda_only
def test_dry_run_keeps_the_gpu_benchmark_figures(dry_run):
    *_, record, out = dry_run
    figures = record["stages"]["gpu"]["figures"]
    assert json.loads((out / "gpu.json").read_text())["rope"] == figures["rope"]
    assert {"copy", "table@1", "none@1"} <= set(figures["rope"]) and figures["rope"]["none@1"]["rotary_dims"] == 64
    train = figures["train"]
    assert train["preset"] == "tiny-llama" and train["tokens_per_s"] > 0
    targets = figures["targets"]
    assert targets["rope_share_table@1"] == {"value": None, "target": 0.7, "met": None}  # CPU: no datasheet peak
    assert targets["train_mfu"] == {"value": train["mfu"], "target": 0.4, "met": train["mfu"] >= 0.4}


@no_cuda_only
def test_dry_run_measures_the_smollm2_shape(dry_run, gpu_check):
    *_, record, _ = dry_run
    figures = record["stages"]["smollm2"]["figures"]
    assert figures["model"]["n_layer"] == 2 and figures["model"]["vocab_size"] == 49_152
    assert figures["params"] == count_params_meta(gpu_check.smollm2_config(2))
    assert "random" in figures["weights"] and "bf16" in figures["step"]
    assert set(figures["runs"]) == {"4x16", "1x64"}
    with torch.device("meta"):
        model = Transformer(gpu_check.smollm2_config(2))
    for run in figures["runs"].values():
        assert run["tokens_per_s"] == pytest.approx(run["batch"] * run["seq"] / run["step_s"])
        flops = model.flops_per_token(run["seq"]) * run["tokens_per_s"]
        assert run["mfu"] == pytest.approx(flops / figures["peak_flops"])  # on a busy CPU it may exceed 1


def test_smollm2_config_is_the_135m_shape(gpu_check):
    config = gpu_check.smollm2_config()
    assert (config.n_layer, config.d_model, config.n_head, config.kv_heads, config.head_size, config.d_ff) == (
        30, 576, 9, 3, 64, 1536)
    assert config.rope.theta == 100_000.0 and config.rope.resolve_dims(64) == 64 and config.tie_embeddings
    assert count_params_meta(config) == 134_515_008  # SmolLM2-135M's parameter count


@no_cuda_only
def test_cuda_test_stage_runs_the_marked_tests(gpu_check, tmp_path):
    """On CPU every test of tests/test_cuda.py, and the fused layers' tests under CUDA autocast, are
    collected by `-m cuda` and skip (no CUDA); the stage reads the counts from its JUnit XML."""
    figures = gpu_check.cuda_tests(tmp_path / "cuda_tests.log", True, 120)
    assert (tmp_path / "cuda_tests.xml").is_file() and figures["junit"] == "cuda_tests.xml"
    assert figures["tests"] == figures["skipped"] >= 40 and figures["passed"] == figures["failed"] == 0
    assert all(line.startswith("skipped: ") and line.endswith("no CUDA") for line in figures["not_passed"])
    fused = [line for line in figures["not_passed"] if "under_cuda_autocast" in line]
    assert {line.split(": ")[1].split("[")[0] for line in fused} == {
        "test_fused_layers_under_cuda_autocast_equal_its_plain_expressions",
        "test_fused_layers_train_as_the_plain_ones_under_cuda_autocast"}
    assert len(fused) == 2 * 5 + 2  # bf16 and fp16: five cases of the layers, one training step


def test_a_failed_stage_is_recorded_and_the_others_still_run(gpu_check, tmp_path, monkeypatch, capsys):
    def crashes(log, dry_run, timeout):
        code = gpu_check.run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log, timeout)
        raise gpu_check.StageFailed(f"exit status {code}")

    def hangs(log, dry_run, timeout):
        gpu_check.run_logged([sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(60)"],
                             log, timeout)
        return {}

    def fine(log, dry_run, timeout):
        return {"figure": 1.5}

    stages = {
        "crashes": gpu_check.Stage(crashes, 60, True, str),
        "hangs": gpu_check.Stage(hangs, 2, True, str),
        "fine": gpu_check.Stage(fine, 60, True, lambda figures: f"figure {figures['figure']}"),
    }
    monkeypatch.setattr(gpu_check, "STAGES", stages)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    output = capsys.readouterr().out
    record = json.loads(output.strip().splitlines()[-1])
    assert record["ok"] is False and record["failed"] == ["crashes", "hangs"]
    crashed, hung, fine = (record["stages"][name] for name in stages)
    assert crashed["status"] == "failed" and crashed["error"] == "exit status 3" and "boom" in crashed["tail"]
    assert hung["status"] == "failed" and hung["error"] == "timed out after 2 s" and "waiting" in hung["tail"]
    assert 2 <= hung["seconds"] < 30
    assert fine["status"] == "ok" and fine["figures"] == {"figure": 1.5}
    assert "figure 1.5" in output and "timed out after 2 s" in output
