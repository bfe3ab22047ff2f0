"""build_optimizer: fused AdamW where torch supports it, with the same update as the unfused one."""

from __future__ import annotations

import copy

import torch

from ropelab.config import ModelConfig, TrainConfig
from ropelab.model import Transformer
from ropelab.train.optim import build_optimizer, fused_supported


def test_fused_adamw_takes_the_unfused_step():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, n_layer=1, d_model=16, n_head=2, d_ff=32, max_seq_len=16))
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    config = TrainConfig(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(model, config)
    assert fused.defaults["fused"] is True
    plain = build_optimizer(twin, config)
    for group in plain.param_groups:
        group["fused"] = None  # the same groups and hyper-parameters, torch's default implementation
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for net, optimizer in ((model, fused), (twin, plain)):
            net(idx, idx)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
    for ours, theirs, before in zip(model.parameters(), twin.parameters(), start.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert not torch.equal(ours, before)


def test_fused_only_for_plain_float_tensors():
    assert fused_supported([torch.zeros(2, requires_grad=True)])
    assert not fused_supported([])
    assert not fused_supported([torch.zeros(2, device="meta")])
