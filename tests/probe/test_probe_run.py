import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open

from ropelab.cli import main
from ropelab.probe import ProbeConfig, parse_modes, run_probe, weight_updates

from probe_helpers import tiny_config, write_run

SMALL = ["--block-len", "16", "--repeats", "4", "--no-progress"]


@pytest.fixture(scope="module")
def probed(two_runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("probe") / "out"
    a, b = two_runs
    code = main(["probe", "run", str(a), str(b), "--out", str(out), "--modes", "causal,doc-restart",
                 "--stages", "q_pre,q_post,block,logits", *SMALL])  # every stage is captured in test_probe_capture
    assert code == 0
    return out


def test_probe_writes_every_file(probed):
    meta = json.loads((probed / "probe.json").read_text())
    assert [c["label"] for c in meta["checkpoints"]] == ["phase1", "phase2"]
    assert meta["modes"] == ["causal-fp32-running", "doc-fp32-restart"] and meta["layers"] == [0, 1]
    assert meta["window"] == 64 and meta["analysis_positions"] == [14, 30, 46, 62]
    expected = {"probe.json", "input.json", "input_ids.npy", "input.txt", "comparison.json", "index.html",
                "weights_phase1__phase2.json", "weights_phase1__phase2.png",
                "lines_causal-fp32-running.png", "lines_doc-fp32-restart.png"}
    for label in ("phase1", "phase2"):
        for mode in meta["modes"]:
            expected |= {f"{label}/{mode}/{name}" for name in ("captures.safetensors", "metrics.json", "heatmaps.png")}
    written = {str(p.relative_to(probed)) for p in probed.rglob("*") if p.is_file()}
    assert written == expected == set(meta["files"])
    for name in expected:
        if name.endswith(".png"):
            assert (probed / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (probed / "index.html").read_text()
    linked = set(re.findall(r'src="([^"]+)"', page))
    assert linked == {n for n in expected if n.endswith(".png")}
    ids = np.load(probed / "input_ids.npy")
    block = json.loads((probed / "input.json").read_text())["block_ids"]
    assert ids.tolist() == block * 4 and block[0] == 257 and block[-1] == 256


def test_probe_metrics_and_comparison(probed):
    with safe_open(str(probed / "phase1/causal-fp32-running/captures.safetensors"), framework="pt") as f:
        assert f.get_tensor("logits").shape == (4, 320) and f.get_tensor("q_post.1").shape == (4, 2, 16)
    doc = json.loads((probed / "phase2/doc-fp32-restart/metrics.json").read_text())["captures"]
    assert all(entry["max_relative_l2"] < 1e-6 for entry in doc.values())
    causal = {label: json.loads((probed / f"{label}/causal-fp32-running/metrics.json").read_text())["captures"]
              for label in ("phase1", "phase2")}
    assert causal["phase1"]["block.1"]["mean_relative_l2"] > 1e-3 and causal["phase1"]["logits"]["mean_kl"] > 0
    assert causal["phase1"]["q_pre.0"]["rotary_dims"] == 8
    comparison = json.loads((probed / "comparison.json").read_text())["causal-fp32-running"]
    entry = comparison["logits"]
    assert entry["values"]["phase1"]["mean_kl"] == causal["phase1"]["logits"]["mean_kl"]
    assert entry["difference"]["phase2"]["mean_kl"] == pytest.approx(
        causal["phase2"]["logits"]["mean_kl"] - causal["phase1"]["logits"]["mean_kl"])
    weights = json.loads((probed / "weights_phase1__phase2.json").read_text())
    assert weights["layers"][0]["theta_a"] == 10_000.0 and weights["layers"][0]["theta_b"] == 500_000.0
    assert len(weights["top_spans"]) == 10


def test_probe_refusals(probed, two_runs, tmp_path, capsys):
    a, _ = two_runs
    assert main(["probe", "run", str(a), "--out", str(probed), *SMALL]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert main(["probe", "run", str(a), "--out", str(tmp_path / "x"), "--modes", "doc-fp16", *SMALL]) == 2
    assert "unknown word 'fp16'" in capsys.readouterr().err
    assert main(["probe", "run", str(tmp_path / "nowhere"), "--out", str(tmp_path / "y"), *SMALL]) == 2
    assert "no such file" in capsys.readouterr().err
    other = write_run(tmp_path / "words", *_word_level_model(tmp_path / "tokenizer.json"))
    assert main(["probe", "run", str(a), str(other), "--out", str(tmp_path / "z"), "--stages", "logits", *SMALL]) == 2
    assert "tokenizer.json' differs from the first checkpoint's" in capsys.readouterr().err
    assert not any(p.name in ("x", "y", "z") for p in tmp_path.iterdir())  # nothing half-written


def _word_level_model(path):
    """A model whose run uses another tokenizer (a two-word tokenizer.json)."""
    from tokenizers import Tokenizer, models

    from ropelab.model import Transformer

    Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(path))
    config = tiny_config(f"data.tokenizer={path}")
    return Transformer(config.model), config


def test_probe_weights_command(two_runs, tmp_path, capsys):
    a, b = two_runs
    assert main(["probe", "weights", str(a), str(b), "--out", str(tmp_path / "w"), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("layer ") == 3 and "wavelength" in out
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["index.html", "weights.json", "weights.png"]
    assert "spans that changed most" in (tmp_path / "w" / "index.html").read_text()
    assert weight_updates(str(a), str(a), tmp_path / "same")["top_spans"][0]["relative_change"] == 0.0


def test_probe_through_hf_import(two_runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, max_position_embeddings=64)).eval()
    hf.save_pretrained(tmp_path / "hf")
    config = ProbeConfig(block_len=16, repeats=3, modes=parse_modes("causal"), stages=("logits",), progress=False)
    meta = run_probe([str(tmp_path / "hf"), str(two_runs[0])], tmp_path / "out", config)
    assert meta["checkpoints"][0]["label"] == "hf" and meta["checkpoints"][0]["rope"][0]["layout"] == "half"
    assert "rotates 16 channels (half) in the first checkpoint and 8" in meta["weights_skipped"]["phase1"]
    ids = torch.from_numpy(np.load(tmp_path / "out" / "input_ids.npy")).unsqueeze(0)
    with torch.no_grad():
        expected = hf(ids).logits[0, meta["analysis_positions"]]
    with safe_open(str(tmp_path / "out/hf/causal-fp32-running/captures.safetensors"), framework="pt") as f:
        torch.testing.assert_close(f.get_tensor("logits"), expected, atol=1e-4, rtol=1e-4)


def test_window_longer_than_the_model_is_refused_or_with_a_scaling_warned_about(tmp_path, capsys):
    from probe_helpers import tiny_model

    short = ("model.max_seq_len=48",)  # SMALL's window: 4 repeats x 16 tokens = 64
    plain = write_run(tmp_path / "plain", tiny_model(0, *short), tiny_config(*short))
    assert main(["probe", "run", str(plain), "--out", str(tmp_path / "a"), "--stages", "logits", *SMALL]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("ropelab: error: plain: the probe window, 4 repeats x 16 tokens = 64, is longer than the model's "
                    "model.max_seq_len=48; choose --block-len and --repeats whose product is at most 48")
    assert not (tmp_path / "a").exists()

    scaled = (*short, "model.rope.scaling={method: linear, factor: 2.0}")
    linear = write_run(tmp_path / "linear", tiny_model(0, *scaled), tiny_config(*scaled))
    assert main(["probe", "run", str(linear), "--out", str(tmp_path / "b"), "--stages", "logits", *SMALL]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["ropelab: warning: linear: the probe window, 4 repeats x 16 tokens = 64, is longer than the "
                        "model's model.max_seq_len=48; probed with its RoPE scaling"]
    assert (tmp_path / "b" / "probe.json").is_file()


def test_a_layer_pattern_is_reported_per_layer_kind(probed, tmp_path):
    from probe_helpers import tiny_model

    layout = ("model.n_layer=4", "model.layer_pattern=LLLG",
              "model.layer_kinds={L: {attention: sliding, window: 12}, G: {rope: none}}")
    run = write_run(tmp_path / "run", tiny_model(0, *layout), tiny_config(*layout))
    config = ProbeConfig(block_len=16, repeats=3, stages=("q_pre", "block"), progress=False)
    meta = run_probe([str(run)], tmp_path / "out", config)
    described = meta["checkpoints"][0]
    assert described["layer_pattern"] == "LLLG"
    assert [(r["layer"], r["kind"], r["rotary_dims"]) for r in described["rope"]] == [
        (0, "L", 8), (1, "L", 8), (2, "L", 8), (3, "G", 0)]
    found = json.loads((tmp_path / "out/run/causal-fp32-running/metrics.json").read_text())
    kinds, captures = found["layer_kinds"], found["captures"]
    assert kinds["L"]["layers"] == [0, 1, 2] and kinds["G"]["layers"] == [3]
    assert kinds["L"]["block"]["mean_relative_l2"] == pytest.approx(
        np.mean([captures[f"block.{layer}"]["mean_relative_l2"] for layer in (0, 1, 2)]))
    assert kinds["G"]["q_pre"] == {key: captures["q_pre.3"][key] for key in ("mean_relative_l2", "mean_cosine_distance")}
    plain = json.loads((probed / "probe.json").read_text())["checkpoints"][0]
    assert "layer_pattern" not in plain and "kind" not in plain["rope"][0]
    assert "layer_kinds" not in json.loads((probed / "phase1/causal-fp32-running/metrics.json").read_text())
