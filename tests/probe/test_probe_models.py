from ropelab.probe.models import checkpoint_labels


def test_labels_are_short_unique_and_folder_safe():
    sources = ["runs/ce", "runs/ce/checkpoints/step_00000060", "other/ce/", "meta-llama/Llama 3.2"]
    assert checkpoint_labels(sources) == ["ce", "ce-step_00000060", "ce-2", "Llama_3.2"]
