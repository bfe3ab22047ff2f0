"""Fixtures of the probe tests."""

import pytest
import torch

from ropelab.model import Transformer

from probe_helpers import tiny_config, tiny_model, write_run


@pytest.fixture(scope="session")
def two_runs(tmp_path_factory):
    """("phase1", "phase2") run folders: the second is the first with perturbed weights and a larger theta."""
    root = tmp_path_factory.mktemp("probe_runs")
    first = tiny_model(0)
    second_config = tiny_config("model.rope.theta=500000")
    second = Transformer(second_config.model)
    second.load_state_dict(first.state_dict())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in second.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return (write_run(root / "phase1", first, tiny_config()), write_run(root / "phase2", second, second_config))
