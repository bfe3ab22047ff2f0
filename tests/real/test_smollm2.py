"""Every path on the real model: fine-tune from it (and resume exactly), export it as a native
LlamaForCausalLM with its tokenizer, distill a small student from it, probe it, evaluate it."""

from __future__ import annotations

import json

import pytest
import torch

from ropelab.config import build_run_config
from ropelab.sources import load, run_config
from ropelab.train.loop import train
from tests.helpers import assert_logits_match

SHORT = ["data.seq_len=32", "train.micro_batch=1", "train.eval_batches=1", "train.progress=false",
         "train.tensorboard=false", "train.lr=1e-4"]


def test_fine_tune_from_smollm2_resumes_exactly(smollm2_folder, tmp_path):
    overrides = [f"train.init_from={smollm2_folder}", *SHORT, "train.steps=3", "train.eval_every=3",
                 "train.checkpoint_every=2"]
    config = run_config(overrides=overrides)
    assert (config.model.n_layer, config.model.d_model, config.model.vocab_size) == (30, 576, 49152)
    straight = train(config, tmp_path / "straight")
    assert straight.init_from["kind"] == "run" and straight.final_train_loss < 6  # a real model: far below ln(49152)
    (tmp_path / "straight" / "result.json").unlink()  # as if killed after the step-2 checkpoint
    resumed = train(out_dir=tmp_path / "straight", resume=True, from_checkpoint=2)
    assert resumed.final_train_loss == straight.final_train_loss and resumed.final_val_loss == straight.final_val_loss


def test_export_is_a_native_llama_with_its_tokenizer(smollm2_folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    from ropelab.export.hf import export_hf

    info = export_hf(smollm2_folder, tmp_path / "hf")
    assert info["architecture"] == "LlamaForCausalLM" and "tokenizer.json" in info["files"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    model, ours, _ = load(smollm2_folder)
    text = "The capital of France is Paris. The capital of Italy is"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == ours.encode_batch([text])[0]
    with torch.no_grad():  # transformers forms the RoPE angles in float32, ropelab in float64
        assert_logits_match(model(ids)[0], hf(ids).logits, model.config, angles_differ=True)


def test_distill_a_small_student_from_smollm2(smollm2_folder, tmp_path):
    import ropelab.distill  # noqa: F401 - registers the KD objective

    config = build_run_config(overrides=[
        "model.n_layer=1", "model.d_model=64", "model.n_head=2", "model.n_kv_head=1", "model.d_ff=128",
        f"data.tokenizer={smollm2_folder / 'tokenizer.json'}", *SHORT, "train.steps=2", "train.eval_every=2",
        "train.checkpoint_every=2", f"distill.teacher={smollm2_folder}", "distill.top_k=64",
    ])
    result = train(config, tmp_path / "student")
    rows = [json.loads(line) for line in (tmp_path / "student" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["kd"] > 0 for row in rows if "kd" in row) and len([r for r in rows if "kd" in r]) == 2
    assert result.steps == 2


def test_probe_runs_on_smollm2(smollm2_folder, tmp_path):
    from ropelab.probe import ProbeConfig, run_probe

    meta = run_probe([str(smollm2_folder)], tmp_path / "probe",
                     ProbeConfig(block_len=64, repeats=4, layers=(0, -1), progress=False))
    assert meta["window"] == 256 and meta["findings"]
