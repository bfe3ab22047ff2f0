"""An MLA folder through the other commands: recovery by KD from the source (`train.init_from`), long-context
evaluation, the probe and its weight updates, context extension (static scalings taken, length-dependent
ones refused in one line)."""

import json

import pytest
import torch

from ropelab.config import ConfigError, RopeScalingConfig
from ropelab.evaluate.extrapolation import scaled_config
from ropelab.evaluate.longctx import evaluate_longctx
from ropelab.mla.attention import LatentAttention
from ropelab.probe import ProbeConfig
from ropelab.probe.runner import run_probe, weight_updates
from ropelab.sources import load
from ropelab.train.loop import train


def test_recovery_by_kd_from_the_source_trains_the_latent(run, mla_folder, tmp_path, tiny_overrides):
    """The run takes the MLA folder's model settings (`run_config`), as `ropelab train` does."""
    import ropelab.distill  # noqa: F401  (registers the KD objective, as the CLI does)
    from ropelab.sources import run_config

    source = mla_folder[0]
    shapes = [o for o in tiny_overrides if not o.startswith(("model.", "data.tokenizer"))]
    result = train(run_config(overrides=[*shapes, f"train.init_from={source}", f"distill.teacher={run}",
                                         "train.steps=8", "train.eval_every=8", "train.lr=3e-3"]), tmp_path / "kd")
    first = json.loads((tmp_path / "kd" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 0 and result.final_val_loss < first["val_loss"]
    before, after = (load(folder).model.blocks[0].attn for folder in (source, tmp_path / "kd"))
    assert isinstance(after, LatentAttention) and after.rank == 6
    assert not torch.equal(before.kv_down.weight, after.kv_down.weight)


def test_long_context_evaluation_runs_on_the_latent(mla_folder, tmp_path):
    out, _ = mla_folder
    results = evaluate_longctx([out], tmp_path / "l", tasks=["passkey", "niah_single_1"], lengths=[512], depths=[0.0],
                               items=1, distractors=2, loss_length=32, loss_windows=2, progress=False)
    entry = results["runs"][0]
    assert len(entry["tasks"]["passkey"]["cells"]) == 1 and entry["loss_by_position"]["buckets"]
    assert len(entry["tasks"]["niah_single_1"]["cells"]) == 1  # greedy generation from the prompt's latent cache


def test_the_probe_and_its_weight_updates_read_the_latent_keys(run, mla_folder, tmp_path):
    out, _ = mla_folder
    config = ProbeConfig(block_len=16, repeats=3, stages=("q_pre", "k_pre", "block"), progress=False)
    meta = run_probe([str(out)], tmp_path / "probe", config)
    assert meta["checkpoints"][0]["rope"][0]["rotary_dims"] == 4
    changes = weight_updates(str(run), str(out), tmp_path / "weights")
    layer = changes["layers"][0]
    assert layer["plan"] and layer["k"]["relative_change"] > 0  # the rank-6 latent is not the source's keys


@pytest.mark.parametrize("method", ["linear", "yarn"])
def test_a_static_scaling_retunes_the_kept_pairs(mla_folder, method):
    model = load(mla_folder[0]).model.eval()
    scaled = scaled_config(model.config, RopeScalingConfig(method=method, factor=2.0, original_max_position=64), "m")
    ids = torch.randint(0, 250, (1, 40))
    with torch.no_grad():
        before = model(ids)[0]
        model.set_rope_scaling(scaled)
        assert (model(ids)[0] - before).abs().max() > 1e-4


@pytest.mark.parametrize("method", ["dynamic", "longrope"])
def test_a_length_dependent_scaling_is_refused_in_one_line(mla_folder, method):
    config = load(mla_folder[0]).model.config
    extra = {"long_factor": [1.0] * 2, "short_factor": [1.0] * 2} if method == "longrope" else {}
    with pytest.raises(ConfigError, match=f"{method}: model.mla: layer 0's RoPE scaling {method} follows the current "
                                          "length") as error:
        scaled_config(config, RopeScalingConfig(method=method, factor=2.0, original_max_position=64, **extra), method)
    assert "\n" not in str(error.value)


def test_a_run_from_a_full_source_with_model_mla_converts_at_its_start(run, tmp_path, tiny_overrides):
    from ropelab.sources import run_config

    config = run_config(overrides=[
        *tiny_overrides, "data.tokenizer=bpe:300", f"train.init_from={run}", "model.rope.keep_pairs=2",
        "model.rope.select=2-norm", "model.mla={rank: 6}", "train.steps=2", "train.eval_every=2",
        "train.checkpoint_every=2", "train.calibration_tokens=256"])
    result = train(config, tmp_path / "mla")
    assert result.init_from["conversion"]["mla_rank"] == 6 and result.init_from["conversion"]["kl_to_source"] > 0
    model = load(tmp_path / "mla").model
    assert model.config.mla.rank == 6 and model.blocks[0].attn.rotary_dims == 4


def test_a_run_from_an_mla_source_keeps_its_rank(mla_folder, tmp_path, tiny_overrides):
    from ropelab.sources import run_config
    from ropelab.sources.init import check_init

    config = run_config(overrides=[*tiny_overrides, "data.tokenizer=bpe:300", f"train.init_from={mla_folder[0]}",
                                   "model.mla={rank: 4}"])
    with pytest.raises(ConfigError, match=r"model.mla.rank=4 but the source is an MLA model of rank 6"):
        check_init(config)
