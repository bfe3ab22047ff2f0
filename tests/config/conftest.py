import pytest


@pytest.fixture()
def no_training(monkeypatch):
    """`ropelab train` stops where it would start training: a test of a refused config fails fast, instead of
    training for minutes, should the config ever be accepted."""
    import ropelab.train.loop

    def would_train(*args, **kwargs):
        raise AssertionError("the config was accepted: it would train")

    monkeypatch.setattr(ropelab.train.loop, "train", would_train)
