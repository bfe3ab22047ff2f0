"""RULER through a model: greedy generation from the prompt's KV cache, item scoring, and
`ropelab eval longctx --tasks ruler` end to end on the shared tiny run (what the report says: the
RULER-11 mean only for all 11 tasks, intervals, the threshold's source, BOS, the essay haystack and
its repeats), bad input included."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import yaml

from ropelab.cli import main
from ropelab.config import build_run_config
from ropelab.data.tokenizer import ByteTokenizer
from ropelab.errors import ConfigError
from ropelab.evaluate.longctx import evaluate_longctx
from ropelab.evaluate.longctx_candidates import candidate_logits, candidate_slots
from ropelab.evaluate.ruler_eval import greedy_continuation, score_ruler_items, stop_ids
from ropelab.evaluate.ruler_items import RULER_TASK_NAMES, RulerItem
from ropelab.evaluate.ruler_score import postprocess
from ropelab.kv_cache import KVCache
from ropelab.mla.convert import latent_model
from ropelab.model import Transformer
from ropelab.sources.plans import apply_plan, resolve_plans, target_config

BYTES = ByteTokenizer()


def tiny_model(seed: int = 0) -> Transformer:
    """A random tiny model whose greedy output varies (the initialisation alone repeats one token)."""
    config = build_run_config(overrides=[
        "model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.n_kv_head=2", "model.d_ff=64",
        "data.tokenizer=bytes", "data.seq_len=32",
    ])
    config.model.vocab_size = 260
    torch.manual_seed(seed)
    model = Transformer(config.model).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    return model


def plain_greedy(model, prompt: np.ndarray, steps: int) -> list[int]:
    """Greedy decoding with one full forward per token, no cache."""
    sequence = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            sequence.append(int(model(torch.tensor(sequence)[None])[0][0, -1].argmax()))
    return sequence[len(prompt):]


def tiny_latent_model() -> Transformer:
    """`tiny_model` converted to multi-head latent attention (2 of 4 pairs per KV head, by made-up 2-norm
    scores, so each KV head keeps pairs of its own, rank 5): its cache holds the rotated pair keys and the
    latent, not keys and values."""
    model = tiny_model(seed=3)
    scores = [torch.rand(2, 4, generator=torch.Generator().manual_seed(layer)) for layer in range(2)]
    plans, config = resolve_plans(target_config(model.config, 2, "2-norm"), scores)
    return latent_model(apply_plan(model, config, plans), 5, "svd-joint").eval()


@pytest.mark.parametrize("make", [lambda: tiny_model(seed=3), tiny_latent_model], ids=["gqa", "mla"])
def test_generation_from_the_kept_cache_is_plain_greedy_decoding(make):
    model = make()
    prompt = np.random.default_rng(2).integers(0, 256, 50)
    expected = plain_greedy(model, prompt, 12)
    cache = KVCache()
    candidates = [[[1, 2, 3], [4, 5]]]
    logits = candidate_logits(model, prompt[None], candidate_slots(candidates, BYTES.eos_id), keep=cache)
    assert cache.get_seq_length() == len(prompt) and len(cache.keys) == 2
    first = int(logits[0, 0, 0].argmax())
    assert greedy_continuation(model, cache, first, 12, {BYTES.eos_id}) == expected
    new = next(k for k in range(1, 12) if expected[k] not in expected[:k])  # the first token unlike those before it
    cache = KVCache()
    candidate_logits(model, prompt[None], candidate_slots(candidates, BYTES.eos_id), keep=cache)
    assert greedy_continuation(model, cache, first, 12, {expected[new]}) == expected[:new]  # stops there
    assert len(set(expected)) > 2
    assert greedy_continuation(model, KVCache(), BYTES.eos_id, 12, {BYTES.eos_id}) == []


def test_stop_ids_hold_the_eos_and_chat_end_markers():
    assert stop_ids(BYTES) == {BYTES.eos_id}

    class Vocab:
        def token_to_id(self, token):
            return {"<|im_end|>": 2, "<|endoftext|>": 0}.get(token)

    class Tok:
        eos_id, tok = 0, Vocab()

    assert stop_ids(Tok()) == {0, 2}


def test_items_are_scored_by_their_greedy_output():
    model = tiny_model(seed=5)
    prompt = np.asarray(BYTES.encode_batch(["What is the special magic number? It is"])[0], dtype=np.int64)
    expected = postprocess(BYTES.decode(plain_greedy(model, prompt, 6)))
    references = [expected[:2], "no such text"]
    item = RulerItem("niah_single_1", len(prompt) + 6, 0, prompt, references,
                     BYTES.encode_batch([" 1234567", " 7654321"]), 6, 0)
    (result,) = score_ruler_items(model, [item], BYTES)
    assert expected and result["output"] == expected
    assert result["score"] == 50.0
    assert 1.0 <= result["rank"] <= 2.0 and result["prompt_tokens"] == len(prompt)


# ------------------------------------------------------------------ end to end


QUICK = dict(lengths=[2500], items=1, distractors=3, loss_windows=0, progress=False)


def test_ruler_suite_end_to_end(run, tmp_path):
    out = tmp_path / "ruler"
    results = evaluate_longctx([run], out, tasks=["ruler"], **QUICK)
    assert tuple(results["settings"]["tasks"]) == RULER_TASK_NAMES
    assert sorted(p.name for p in out.iterdir()) == ["longctx.json", "longctx.md"]
    (entry,) = results["runs"]
    for name in RULER_TASK_NAMES:
        (cell,) = entry["tasks"][name]["cells"]
        (item,) = cell["items"]
        assert cell["length"] == 2500 and 0 <= cell["score"] <= 100 and 1 <= item["rank"] <= 4
        assert item["prompt_tokens"] <= 2500 - {"vt": 30, "cwe": 120, "fwe": 50}.get(name, 128)
        assert cell["n"] == 1 and 0 <= cell["interval"][0] <= cell["score"] <= cell["interval"][1] <= 100
    summary = entry["ruler"]
    assert summary["threshold"] == 85.6 and set(summary["average"]) == {"2500"} and summary["complete"]
    assert summary["bos"] == "none" and summary["haystack_repeats"] == []
    stored = json.loads((out / "longctx.json").read_text())
    assert stored["runs"][0]["ruler"]["effective_length_text"] == summary["effective_length_text"]
    assert stored["settings"]["haystack"] == "wiki-prose" and stored["haystack"]["name"] == "wiki-prose"
    table = (out / "longctx.md").read_text()
    assert "## RULER" in table and "| niah_multikey_3 |" in table and "| RULER-11 (synthetic, no QA) |" in table
    assert f"**{summary['effective_length_text']}**" in table and "answer rank (MRR)" in table
    assert "85.6 is Llama-2-7B-chat's mean score over RULER's 13 tasks" in table and "chat template" in table
    assert "95% Wilson score interval" in table and "BOS: none." in table
    assert "Essay haystack (niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue, niah_multiquery): " \
           "**wiki-prose**, Wikipedia lead sections" in table
    score = entry["tasks"]["vt"]["cells"][0]
    assert f"| vt | {score['score']:.1f} ({score['interval'][0]:.1f}–{score['interval'][1]:.1f}, n=1) |" in table


def test_cli_mixes_passkey_and_ruler_and_takes_a_threshold(run, tmp_path, capsys):
    args = ["eval", "longctx", str(run), "--tasks", "passkey,niah_single_1,vt", "--lengths", "2500", "--depths", "0.5",
            "--items", "1", "--distractors", "2", "--loss-windows", "0", "--threshold", "0", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "ok")]) == 0
    printed = capsys.readouterr().out
    assert "| passkey | exact match ↑ | 2500 |" in printed and "| niah_single_1 |" in printed and "| vt |" in printed
    assert "No RULER-11 (synthetic, no QA) mean and no effective length: they need all 11 tasks, and 2 ran." in printed
    assert "| RULER-11" not in printed and "Effective length" not in printed
    assert "Essay haystack: wiki-prose (none of the tasks run uses it)." in printed
    stored = json.loads((tmp_path / "ok" / "longctx.json").read_text())
    assert stored["runs"][0]["ruler"]["tasks"] == ["niah_single_1", "vt"]
    assert not {"average", "effective_length", "threshold"} & set(stored["runs"][0]["ruler"])


def test_cli_reads_ruler_s_essay_file_and_warns_when_the_haystack_repeats(run, tmp_path, capsys):
    essays = tmp_path / "PaulGrahamEssays.json"
    essays.write_text(json.dumps({"text": "Startups are hard. Most of them fail, and that is normal.\n\nWork on it."}))
    args = ["eval", "longctx", str(run), "--tasks", "niah_single_2,niah_single_1", "--lengths", "1000,1500",
            "--items", "1", "--distractors", "2", "--loss-windows", "0", "--haystack", str(essays), "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"ropelab: warning: niah_single_2 at {n} tokens: the essay haystack {essays} runs out of text and repeats it"
        for n in (1000, 1500)]
    stored = json.loads((tmp_path / "out" / "longctx.json").read_text())
    assert stored["settings"]["haystack"] == str(essays) and stored["haystack"]["name"] == str(essays)
    assert stored["runs"][0]["ruler"]["haystack_repeats"] == [{"task": "niah_single_2", "length": n} for n in (1000, 1500)]
    assert stored["runs"][0]["tasks"]["niah_single_2"]["cells"][0]["items"][0]["haystack_repeats"]
    assert f"Essay haystack (niah_single_2): **{essays}**, the essay file {essays} (14 words" in captured.out
    assert "repeats its text (the haystack needs more words than it has) in: niah_single_2 at 1000, " \
           "niah_single_2 at 1500." in captured.out


@pytest.mark.parametrize("option, value, key", [
    ("--tasks", "niah_single_1,niah_single_9", "niah_single_9"), ("--threshold", "101", "threshold=101.0"),
    ("--threshold", "-1", "threshold=-1.0"), ("--haystack", "essays.json", "haystack=essays.json: not a built-in"),
    ("--haystack", "BAD_JSON", "not a JSON file"),
])
def test_cli_bad_input_is_one_line_naming_the_key(run, tmp_path, capsys, option, value, key):
    if value == "BAD_JSON":
        value = str(tmp_path / "essays.json")
        (tmp_path / "essays.json").write_text('{"text": "unfinished')
    essay_task = ["--tasks", "niah_single_2"] if option == "--haystack" else []
    args = ["eval", "longctx", str(run), "--lengths", "2500", "--loss-windows", "0", "--no-progress", option, value,
            *essay_task, "--out", str(tmp_path / "bad")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and key in err
    assert not (tmp_path / "bad").exists()


@pytest.fixture(scope="module")
def short_context_runs(run, tmp_path_factory):
    """Copies of the shared run with model.max_seq_len 1024, one of them with linear RoPE scaling."""
    copies = []
    for name, scaling in (("plain", None), ("scaled", {"method": "linear", "factor": 2.0})):
        copy = tmp_path_factory.mktemp(name) / "run"
        shutil.copytree(run, copy)
        config = yaml.safe_load((copy / "config.yaml").read_text())
        config["model"]["max_seq_len"] = 1024
        config["model"]["rope"]["scaling"] = scaling
        (copy / "config.yaml").write_text(yaml.safe_dump(config))
        copies.append(copy)
    return copies


def test_a_length_past_the_model_needs_rope_scaling(short_context_runs, tmp_path):
    plain, scaled = short_context_runs
    with pytest.raises(ConfigError, match="beyond the model's max_seq_len 1024"):
        evaluate_longctx([plain], tmp_path / "plain", tasks=["niah_single_1"], **QUICK)
    results = evaluate_longctx([scaled], tmp_path / "scaled", tasks=["niah_single_1"], **QUICK)
    assert results["runs"][0]["tasks"]["niah_single_1"]["cells"][0]["length"] == 2500
