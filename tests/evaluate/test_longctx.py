"""Long-context evaluation: item construction, scoring on a rigged model, the prefix cache, loss by
position, and `evaluate_longctx` / `ropelab eval longctx` end to end on the shared tiny run."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from hypothesis import given, settings as hsettings, strategies as st
from torch import nn

from ropelab.cli import main
from ropelab.config import ConfigError, build_run_config
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.data.tokens import Shard, TokenSplit
from ropelab.evaluate.longctx import (
    bucket_means, evaluate_longctx, greedy_along, log_buckets, loss_by_position, position_windows, score_items,
    summarize_cell,
)
from ropelab.evaluate.longctx_candidates import candidate_logits, candidate_slots, rank_of_true
from ropelab.evaluate.longctx_items import TASK_TEXT, Item, LongContextSettings, build_items, haystack_source
from ropelab.model import Transformer

BYTES = ByteTokenizer()


def split_of(*documents: np.ndarray) -> TokenSplit:
    tokens = np.concatenate(documents).astype(np.uint16)
    offsets = np.cumsum([0] + [len(d) for d in documents]).astype(np.int64)
    return TokenSplit([Shard(tokens, offsets)])


def text_split(seed: int = 0, n: int = 6000) -> TokenSplit:
    rng = np.random.default_rng(seed)
    return split_of(rng.integers(97, 123, n))  # lowercase letters: no digit in the haystack


def settings(**kw) -> LongContextSettings:
    base = dict(lengths=(200, 400), depths=(0.0, 0.3, 1.0), items=2, distractors=4, loss_windows=0)
    return LongContextSettings(**(base | kw)).validate()


def tiny_model(*overrides: str, seed: int = 0) -> Transformer:
    config = build_run_config(overrides=[
        "model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=64",
        "data.tokenizer=bytes", "data.seq_len=32", *overrides,
    ])
    config.model.vocab_size = 260
    torch.manual_seed(seed)
    return Transformer(config.model).eval()


# ------------------------------------------------------------------ items


@pytest.mark.parametrize("task", ["passkey", "needle"])
def test_items_depend_on_the_seed_only(task):
    source = haystack_source(BYTES, task, text_split(), 400)
    a = build_items(BYTES, task, source, settings())
    b = build_items(BYTES, task, haystack_source(BYTES, task, text_split(), 400), settings())
    c = build_items(BYTES, task, source, settings(seed=1))
    assert [it.answer for it in a] == [it.answer for it in b]
    assert all(np.array_equal(x.prompt, y.prompt) and x.candidates == y.candidates for x, y in zip(a, b))
    assert [it.answer for it in a] != [it.answer for it in c]
    # every depth of a (length, item) cell hides the same answer in the same haystack
    for length in (200, 400):
        for index in range(2):
            same = [it for it in a if it.length == length and it.index == index]
            assert len(same) == 3 and len({it.answer for it in same}) == 1
            needle_len = len(BYTES.encode_batch([TASK_TEXT[task].needle.format(answer=same[0].answer)])[0])
            hay = {tuple(np.delete(it.prompt, range(it.needle_at, it.needle_at + needle_len))) for it in same}
            assert len(hay) == 1


@hsettings(max_examples=30, deadline=None)
@given(length=st.integers(120, 700), depth=st.floats(0, 1), task=st.sampled_from(["passkey", "needle"]))
def test_needle_lands_at_the_requested_depth(length, depth, task):
    s = settings(lengths=(length,), depths=(depth,), items=1)
    (item,) = build_items(BYTES, task, haystack_source(BYTES, task, text_split(), length), s)
    text = TASK_TEXT[task]
    needle, question = BYTES.encode_batch([text.needle.format(answer=item.answer), text.question])
    hay_len = length - len(needle) - len(question)
    assert len(item.prompt) == length
    assert item.needle_at == round(depth * hay_len)
    assert list(item.prompt[item.needle_at : item.needle_at + len(needle)]) == needle
    assert list(item.prompt[-len(question):]) == question
    assert BYTES.decode(item.candidates[0]) == " " + item.answer and len(item.answer) == 5
    assert len({BYTES.decode(c) for c in item.candidates}) == len(item.candidates) == 5


def test_haystack_longer_than_the_validation_split_is_refused():
    with pytest.raises(ConfigError, match="validation split has 6000 tokens"):
        build_items(BYTES, "needle", text_split(), settings(lengths=(7000,)))


# ------------------------------------------------------------------ scoring


class Bigram(nn.Module):
    """Logits depend on the current token only: lm_head row `next`, column `current`."""

    def __init__(self, rigged: dict[str, str], strength: float):
        super().__init__()
        V = BYTES.vocab_size
        self.lm_head = nn.Linear(V, V, bias=False)
        nn.init.zeros_(self.lm_head.weight)
        for current, following in rigged.items():
            self.lm_head.weight.data[ord(following), ord(current)] = strength
        self.blocks = nn.ModuleList()

    def hidden_states(self, idx, position_ids=None):
        return F.one_hot(idx, BYTES.vocab_size).float()


def hand_item(answer: str, distractors: list[str]) -> Item:
    prompt = np.asarray(BYTES.encode_batch(["What is the magic number? The magic number is"])[0])
    candidates = BYTES.encode_batch([" " + a for a in [answer, *distractors]])
    return Item("needle", len(prompt), 0.5, 0, prompt, 0, answer, candidates)


def test_exact_match_and_rank_on_a_rigged_model():
    a = math.log(50.0)
    model = Bigram({"s": " ", " ": "1", "1": "2", "2": "3", "3": "4", "4": "5", "5": "."}, a)
    items = [hand_item("12345", ["12399", "99999", "55555"]), hand_item("55555", ["12345", "99999", "12399"])]
    first, second = score_items(model, items, BYTES.decode, BYTES.eos_id)
    # After a rigged token its successor has p = 50/308 and any other token 1/308; after any other token
    # all 259 are equally likely. " 12345": 6 rigged steps; " 12399": 4 rigged, then 1/308 and 1/259;
    # " 99999": 1 rigged (" " after "s"), 1/308, then 4 x 1/259; " 55555": 1 rigged, then 5 x 1/308, the least.
    assert first["rank"] == 1.0 and first["exact_match"] and first["generated"] == " 12345."
    assert second["rank"] == 4.0 and not second["exact_match"] and second["generated"] == " 1"
    summary = summarize_cell([first, second])
    assert summary["exact_match"] == 0.5
    assert summary["mrr"] == pytest.approx((1 + 1 / 4) / 2)
    assert summary["acc_at_1"] == 0.5 and summary["mean_rank"] == pytest.approx(2.5)


def test_a_further_digit_after_the_answer_is_not_an_exact_match():
    model = Bigram({"s": " ", " ": "1", "1": "2", "2": "3", "3": "4", "4": "5", "5": "6"}, 5.0)
    (result,) = score_items(model, [hand_item("12345", ["99999"])], BYTES.decode, BYTES.eos_id)
    assert result["generated"] == " 123456" and not result["exact_match"] and result["rank"] == 1.0


def test_rank_counts_ties_as_half():
    assert rank_of_true([-1.0, -2.0, -3.0]) == 1.0
    assert rank_of_true([-2.0, -1.0, -2.0, -3.0]) == 2.5
    assert rank_of_true([-5.0, -1.0, -2.0]) == 3.0


MODEL_VARIANTS = [
    (),
    ("model.block=parallel", "model.norm=layernorm", "model.mlp=gelu", "model.attn_bias=true"),
    ("model.qk_norm=true", "model.rope.fraction=0.25", "model.rope.layout=interleaved"),
    ("model.rope_layers={1: {fraction: 0}}", "model.n_kv_head=4"),
    ("model.n_layer=3", "model.layer_pattern=SCG", "model.layer_kinds={S: {attention: sliding, window: 16}, "
     "C: {attention: chunked, window: 24}, G: {rope: none, temperature: {floor_scale: 4, attn_scale: 0.5}}}"),
]


@pytest.mark.parametrize("overrides", MODEL_VARIANTS)
def test_prefix_cache_gives_the_full_forward_logits(overrides):
    model = tiny_model(*overrides)
    prompts = np.random.default_rng(1).integers(0, 256, (2, 70))
    candidates = [[[49, 50, 51], [52, 53], [54, 55, 56, 57]], [[58], [59, 60, 61, 62], [63, 64]]]
    got = candidate_logits(model, prompts, candidate_slots(candidates, BYTES.eos_id))
    assert got.shape == (2, 3, 5, 260)
    for n, (prompt, row) in enumerate(zip(prompts, candidates)):
        for c, candidate in enumerate(row):
            full, _ = model(torch.tensor(np.concatenate([prompt, candidate]))[None])
            torch.testing.assert_close(got[n, c, : len(candidate) + 1], full[0, len(prompt) - 1 :], rtol=1e-5, atol=1e-5)
    assert all(block.attn.__class__.__name__ == "Attention" for block in model.blocks)  # restored


def test_greedy_read_off_the_true_answer_is_token_by_token_greedy_decoding():
    model = tiny_model(seed=3)
    prompt = np.random.default_rng(2).integers(0, 256, 40)
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(5):  # plain greedy decoding, one full forward per token
            sequence.append(int(model(torch.tensor(sequence)[None])[0][0, -1].argmax()))
    greedy = sequence[len(prompt):]
    followed = greedy[:4]  # the answer is what greedy produces: all of it plus the next token come back
    logits = candidate_logits(model, prompt[None], torch.tensor([[followed]]))[0, 0]
    assert greedy_along(followed, logits.argmax(-1).tolist()) == greedy[:5]
    wrong = greedy[:2] + [(greedy[2] + 1) % 256, greedy[3]]  # leaves greedy at its third token
    logits = candidate_logits(model, prompt[None], torch.tensor([[wrong]]))[0, 0]
    assert greedy_along(wrong, logits.argmax(-1).tolist()) == greedy[:3]


# ------------------------------------------------------------------ loss by position


@hsettings(max_examples=40, deadline=None)
@given(length=st.integers(1, 5000), count=st.integers(1, 20))
def test_log_buckets_partition_the_positions(length, count):
    edges = log_buckets(length, count)
    assert edges[0] == 1 and edges[-1] == length + 1 and np.all(np.diff(edges) > 0) and len(edges) <= count + 1


def test_loss_by_position_and_buckets_equal_a_direct_computation():
    model = tiny_model(seed=4)
    windows = np.random.default_rng(5).integers(0, 256, (3, 41))
    per_position = loss_by_position(model, windows, batch_size=2, chunk=7)
    direct = np.zeros((3, 40))
    with torch.no_grad():
        for w, window in enumerate(windows):
            logits, _ = model(torch.tensor(window[:-1])[None])
            for p in range(40):  # position p + 1 predicts window[p + 1]
                direct[w, p] = F.cross_entropy(logits[0, p], torch.tensor(window[p + 1])).item()
    np.testing.assert_allclose(per_position, direct.mean(0), rtol=1e-5)
    edges = log_buckets(40, 4)
    for bucket, (a, b) in zip(bucket_means(per_position, edges), zip(edges[:-1], edges[1:])):
        values = [direct[w, p - 1] for w in range(3) for p in range(a, b)]
        assert (bucket["start"], bucket["end"]) == (a, b)
        assert bucket["loss"] == pytest.approx(np.mean(values), rel=1e-5)


def test_position_windows_start_at_documents_and_prefer_long_ones():
    docs = [np.full(n, i, dtype=np.int64) for i, n in enumerate([5, 30, 8, 40, 3, 9, 12])]
    split = split_of(*docs)
    windows, single = position_windows(split, 20, 2, seed=0)
    assert single == 2 and sorted(int(w[0]) for w in windows) == [1, 3] and all(len(set(w)) == 1 for w in windows)
    windows, single = position_windows(split, 20, 4, seed=0)
    starts = sorted(int(w[0]) for w in windows)
    assert single == 2 and len(starts) == 4 and {1, 3} <= set(starts)
    assert all(len(set(w)) > 1 for w in windows if w[0] not in (1, 3))  # run on through the packed stream


def test_position_windows_inside_lie_in_one_long_document_at_distinct_offsets():
    docs = [np.arange(n, dtype=np.int64) + 1000 * i for i, n in enumerate([5, 30, 8, 40, 3, 9, 12])]
    split = split_of(*docs)
    windows, single = position_windows(split, 20, 12, seed=3, place="inside")
    assert windows.shape == (12, 21) and single == 12
    for w in windows:  # one document (same thousand), consecutive tokens: cut from inside it
        assert len(set(w // 1000)) == 1 and int(w[0] // 1000) in (1, 3) and np.all(np.diff(w) == 1)
    assert len({tuple(w) for w in windows}) == 12
    # documents of 30 and 40 tokens hold 10 + 20 window starts: 31 windows cannot be cut
    with pytest.raises(ConfigError, match="window starts"):
        position_windows(split, 20, 31, seed=0, place="inside")
    with pytest.raises(ConfigError, match="loss_place"):
        position_windows(split, 20, 2, seed=0, place="middle")


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def two_runs(run, tmp_path_factory):
    """The shared tiny BPE run and a copy evaluated with RoPE theta 500000."""
    copy = tmp_path_factory.mktemp("theta") / "theta500k"
    shutil.copytree(run, copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["model"]["rope"]["theta"] = 500000.0
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    return run, copy


QUICK = dict(lengths=[160, 256], depths=[0.0, 1.0], items=1, distractors=3, loss_windows=2, progress=False)


def test_evaluate_longctx_writes_reports_for_every_run(two_runs, tmp_path):
    out = tmp_path / "longctx"
    results = evaluate_longctx(list(two_runs), out, **QUICK)
    assert sorted(p.name for p in out.iterdir()) == ["longctx.json", "longctx.md", "longctx_heatmap.png", "loss_by_position.png"]
    assert json.loads((out / "longctx.json").read_text())["runs"][1]["rope_theta"] == 500000.0
    a, b = results["runs"]
    for task in ("passkey", "needle"):
        assert a["tasks"][task]["items_fingerprint"] == b["tasks"][task]["items_fingerprint"]
        cells = a["tasks"][task]["cells"]
        assert [(c["length"], c["depth"]) for c in cells] == [(160, 0.0), (160, 1.0), (256, 0.0), (256, 1.0)]
        assert all(0 <= c["mrr"] <= 1 and 1 <= c["mean_rank"] <= 4 for c in cells)
    assert a["loss_by_position"]["length"] == 256 and a["loss_by_position"]["buckets"][-1]["end"] == 257
    assert a["loss_by_position"]["loss_beyond_train_len"] is not None  # trained at 32 tokens
    assert a["loss_by_position"]["buckets"] != b["loss_by_position"]["buckets"]  # theta changes the model
    table = (out / "longctx.md").read_text()
    assert "| passkey | MRR ↑ | 256 |" in table and "theta500k" in table
    with pytest.raises(ConfigError, match="already holds long-context results"):
        evaluate_longctx([two_runs[0]], out, **QUICK)


def test_bad_inputs_fail_before_any_work(two_runs, tmp_path):
    run = two_runs[0]
    with pytest.raises(ConfigError, match="max_seq_len 8192"):
        evaluate_longctx([run], tmp_path / "a", **(QUICK | {"lengths": [8190]}))
    with pytest.raises(ConfigError, match="not a ropelab run directory"):
        evaluate_longctx([tmp_path], tmp_path / "b", **QUICK)
    with pytest.raises(ConfigError, match="cannot hold the passkey needle"):
        evaluate_longctx([run], tmp_path / "c", **(QUICK | {"lengths": [20]}))
    with pytest.raises(ConfigError, match="needle depths"):
        evaluate_longctx([run], tmp_path / "d", **(QUICK | {"depths": [1.5]}))
    with pytest.raises(ConfigError, match="unknown long-context option"):
        evaluate_longctx([run], tmp_path / "e", **(QUICK | {"length": [256]}))
    assert not any(tmp_path.iterdir())


def test_empty_validation_split_is_one_clear_error(two_runs, tmp_path):
    folder = tmp_path / "tokens"
    folder.mkdir()
    np.arange(50, dtype=np.uint16).tofile(folder / "train-00000.bin")
    np.save(folder / "train-00000.idx.npy", np.array([0, 50], dtype=np.int64))
    shard = {"name": "train-00000", "tokens": 50, "documents": 1, "max_token_id": 49}
    manifest = {
        "format": "ropelab-shards-1", "tokenizer": "bytes", "tokenizer_fingerprint": "bytes-v1", "vocab_size": 259,
        "eos_id": 256, "bos_id": 257, "pad_id": 258, "dtype": "uint16",
        "splits": {"train": {"tokens": 50, "documents": 1, "max_token_id": 49, "shards": [shard]},
                   "validation": {"tokens": 0, "documents": 0, "max_token_id": 0, "shards": []}},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    copy = tmp_path / "run"
    shutil.copytree(two_runs[0], copy)
    config = yaml.safe_load((copy / "config.yaml").read_text())
    config["data"]["corpus"] = str(folder)
    config["data"]["tokenizer"] = "bytes"
    (copy / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="validation split of .* is empty"):
        evaluate_longctx([copy], tmp_path / "out", **QUICK)


def test_cli_prints_the_table_and_reports_mistakes_in_one_line(two_runs, tmp_path, capsys):
    args = ["eval", "longctx", str(two_runs[0]), "--lengths", "160", "--depths", "0.5", "--items", "1",
            "--distractors", "2", "--loss-windows", "1", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "| needle | exact match ↑ | 160 |" in out and "longctx.json" in out
    assert main(args + ["--out", str(tmp_path / "bad"), "--tasks", "passkey,haystack"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "haystack" in err
