import pytest
import torch

from ropelab.config import build_run_config
from ropelab.train.validation import evaluate_loss


@pytest.mark.parametrize("world", [2, 3])
def test_validation_split_across_ranks_gives_the_one_process_mean(tiny_overrides, world):
    """Each rank's share, summed as the all-reduce would, gives the one-process figure; every rank runs
    the same number of forwards even when the windows do not divide evenly (3 ranks, 8 windows)."""
    from ropelab.data.pipeline import build_loaders
    from ropelab.data.tokenizer import padded_vocab
    from ropelab.model import Transformer
    from ropelab.train.distributed import DistEnv

    config = build_run_config(overrides=tiny_overrides + ["train.eval_batches=8", "train.micro_batch=1"])
    _, val_loader, manifest = build_loaders(config)
    config.model.vocab_size = padded_vocab(manifest["vocab_size"])
    torch.manual_seed(0)
    model = Transformer(config.model)
    forwards, shares = [], []

    class Share(DistEnv):
        def sum(self, values, device):
            shares.append(values)
            return [1.0, 1.0]

    for rank in range(world):
        calls = []
        handle = model.register_forward_hook(lambda *_: calls.append(1))
        evaluate_loss(model, val_loader, config, torch.device("cpu"), Share(rank=rank, world=world))
        handle.remove()
        forwards.append(len(calls))
    one = evaluate_loss(model, val_loader, config, torch.device("cpu"))
    total, tokens = (sum(share[i] for share in shares) for i in range(2))
    assert tokens == 8 * 32
    assert total / tokens == pytest.approx(one, rel=1e-6)
    assert forwards == [-(-8 // world)] * world  # rank 2 of 3 holds 2 windows and repeats one uncounted
