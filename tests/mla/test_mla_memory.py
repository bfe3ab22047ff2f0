"""`ropelab memory --mla`: the key/value cache per token of MHA/GQA against MLA budgets."""

import dataclasses
import re

import pytest

from ropelab.cli import main
from ropelab.config import ModelConfig, RopeConfig
from ropelab.config.mla import MLAConfig
from ropelab.mla.memory import mla_cache_rows, parse_budgets
from ropelab.study.memory import layer_kind_memory

# SmolLM2-135M's attention shapes: 30 layers, 9 query heads, 3 KV heads of 64 channels
SMOLLM2 = ModelConfig(n_layer=30, d_model=576, n_head=9, n_kv_head=3, d_ff=1536, vocab_size=49152)


def test_mha2mla_135m_budget_caches_36_of_384_values_per_layer():
    rows = {r["cache"]: r for r in mla_cache_rows(SMOLLM2, "smollm2", parse_budgets("2:8, 4:16"), value_bytes=2)}
    gqa, mla = rows["GQA"], rows["MLA r=2 d=8"]
    assert (gqa["values_per_token_layer"], mla["values_per_token_layer"]) == (384, 36)
    assert mla["saved"] == pytest.approx(1 - 36 / 384, abs=1e-4) and rows["MLA r=4 d=16"]["values_per_token_layer"] == 72
    assert mla["bytes_per_token"] == 36 * 2 * 30 and mla["bytes_at_8192"] == 36 * 2 * 30 * 8192


def test_a_run_configs_mla_cache_is_what_its_layers_hold():
    config = dataclasses.replace(SMOLLM2, rope=RopeConfig(keep_pairs=2, select="high", style="slice"),
                                 mla=MLAConfig(rank=8))
    config.validate()
    [row] = layer_kind_memory(config, 8192, "bf16")
    assert row["kv_cache_bytes"] == 30 * 3 * (8 + 4) * 8192 * 2


@pytest.mark.parametrize("args, message", [
    (["--mla", "2-8"], r"--mla: '2-8': each budget is PAIRS:RANK"),
    (["--mla", "33:8"], r"--mla 33:8: tiny-llama has 32 pairs per KV head"),
    (["--mla", "2:200"], r"--mla 2:200: the rank must be in 1\.\.124 for tiny-llama"),
    (["--model", "smollm2-135m"], r"--model: only with --mla"),
])
def test_bad_budgets_are_one_line(args, message, capsys):
    assert main(["memory", "--presets", "tiny-llama", "--fractions", "1", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_the_command_prints_the_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # rich wraps to the terminal's width
    assert main(["memory", "--presets", "tiny-llama", "--fractions", "1", "--mla", "2:8"]) == 0
    out = capsys.readouterr().out
    assert "MHA/GQA against MLA" in out
    assert re.search(r"MLA r=2 d=8 .* 12 .* 90\.6%", out)  # tiny-llama: one KV head of 64 channels, 12 of 128 values
