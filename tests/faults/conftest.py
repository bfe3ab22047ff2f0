import pytest
import torch

from ropelab.config import build_run_config
from ropelab.train.loop import train

from .helpers import fault_overrides


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a fault-injection case that takes long on 2 CPU cores")


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """One intra-op thread here and in the child processes (OMP_NUM_THREADS=1), so that a run resumed
    in another process computes bit for bit what the reference computed in this one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_session_overrides, ropelab_cache):
    """The uninterrupted run of the faults' config (one process), once per module; read-only."""
    run = tmp_path_factory.mktemp("reference") / "run"
    train(build_run_config(overrides=fault_overrides(tiny_session_overrides)), run)
    return run
