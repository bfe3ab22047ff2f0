from ropelab.probe.models import checkpoint_labels, is_hf_source


def test_labels_are_short_unique_and_folder_safe():
    sources = ["runs/ce", "runs/ce/checkpoints/step_00000060", "other/ce/", "meta-llama/Llama 3.2"]
    assert checkpoint_labels(sources) == ["ce", "ce-step_00000060", "ce-2", "Llama_3.2"]


def test_hf_sources(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("")
    (tmp_path / "run" / "config.json").write_text("{}")
    assert is_hf_source(str(tmp_path / "hf")) and not is_hf_source(str(tmp_path / "run"))
    assert is_hf_source("meta-llama/Llama-3.2-1B") and not is_hf_source(str(tmp_path / "missing"))
    assert not is_hf_source("./org/name")


def test_checkpoint_of_a_phase_gets_that_phases_theta(tmp_path):
    from ropelab.probe.models import load_probe_model

    from probe_helpers import tiny_config, tiny_model, write_run

    config = tiny_config("train.phases=[{name: short, steps: 5}, {name: long, steps: 3, overrides: {model.rope.theta: 500000}}]")
    for name, step in (("short", 5), ("long", 8)):
        run = write_run(tmp_path / name, tiny_model(0), config, step=step)
        model, phase_config = load_probe_model(str(run))
        theta = 10_000.0 if name == "short" else 500_000.0
        assert model.ropes[0].theta == theta and phase_config.model.rope.theta == theta
