"""MLA on the real model (SmolLM2-135M: 9 query heads, 3 KV heads of 64 channels, 30 layers): exact at full
rank, and at the budget of MHA2MLA's SmolLM-135M config (2 pairs, rank 8 per KV head: 36 of 384 cached values
per layer) the absorbed decoding over the latent cache gives the materialised tokens and logits."""

from __future__ import annotations

import pytest
import torch

from ropelab.kv_cache import KVCache
from ropelab.mla.attention import latent_cache_values, set_absorb
from ropelab.mla.convert import latent_model
from ropelab.sources import load
from ropelab.sources.plans import apply_plan, resolve_plans, target_config
from tests.helpers import assert_logits_match


@pytest.fixture(scope="module")
def two_pairs(smollm2_folder):
    """The source in fp32 keeping its 2 fastest pairs per KV head, and a prompt."""
    source, tokenizer, _ = load(smollm2_folder)
    source = source.float().eval()
    plans, config = resolve_plans(target_config(source.config, 2, "high"))
    ids = torch.tensor([tokenizer.encode_batch(["The capital of France is Paris. The capital of Italy is"])[0]])
    return apply_plan(source, config, plans).eval(), ids


def test_full_rank_gives_the_planned_models_logits(two_pairs):
    planned, ids = two_pairs
    converted = latent_model(planned, 124).eval()  # min(576, (64 - 4) + 64)
    with torch.no_grad():
        assert_logits_match(converted(ids)[0], planned(ids)[0], planned.config)


def test_mha2mla_budget_decodes_the_same_absorbed_as_materialised(two_pairs):
    planned, ids = two_pairs
    model = latent_model(planned, 8).eval()
    assert (latent_cache_values(model) // 30, latent_cache_values(planned) // 30) == (36, 384)
    runs = []
    for absorb in (True, False):
        set_absorb(model, absorb)
        cache, tokens, steps = KVCache(), ids, []
        with torch.no_grad():
            logits = model(tokens, kv_cache=cache)[0][:, -1:]
            for _ in range(4):
                steps.append(logits)
                tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
                logits = model(tokens[:, -1:], kv_cache=cache)[0]
        runs.append((tokens, torch.cat(steps, dim=1)))
        assert cache.values[0].shape == (1, 3, tokens.shape[1], 8) and cache.keys[0].shape[-1] == 4
    (absorbed_ids, absorbed), (materialised_ids, materialised) = runs
    assert torch.equal(absorbed_ids, materialised_ids)
    # fp32 over 30 layers: both paths lie 2-5e-4 from a float64 run here, so they are compared by rounding
    assert_logits_match(absorbed, materialised, model.config, keys=absorbed_ids.shape[1])
