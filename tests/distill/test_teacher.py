"""Teacher loading: HF and ropelab teachers give their own logits; refusals are one-line ConfigErrors."""

from __future__ import annotations

import pytest
import torch

from ropelab.config import ConfigError
from ropelab.distill.teacher import check_teacher, load_teacher

transformers = pytest.importorskip("transformers")


def _ids(vocab: int, T: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, T), generator=g)
    return ids, torch.arange(T).expand(2, T) + 5  # positions need not start at 0 (running positions)


def test_hf_teacher_with_padding_rows_gives_its_logits(make_hf_teacher, bpe_file, student_config):
    folder = make_hf_teacher(320, bpe_file)  # 300 tokens + 20 padding rows
    config = student_config(f"data.tokenizer={bpe_file}", f"distill.teacher={folder}")
    info = check_teacher(config)
    assert (info.source.kind, info.rows, info.vocab) == ("hf", 320, 300)
    teacher = load_teacher(config)
    assert teacher.weight.shape[0] == 300 and not teacher.module.training
    assert all(not p.requires_grad for p in teacher.module.parameters())

    ids, pos = _ids(300)
    targets = teacher.targets(ids, pos)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        expected = hf(input_ids=ids, position_ids=pos).logits[..., :300]
    got = targets.logits(torch.arange(ids.numel())).view(2, 12, 300)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_hf_teacher_document_mask_isolates_documents(make_hf_teacher, bpe_file, student_config):
    folder = make_hf_teacher(300, bpe_file)
    teacher = load_teacher(student_config(f"data.tokenizer={bpe_file}", f"distill.teacher={folder}"))
    ids, pos = _ids(300, seed=1)
    docs = torch.tensor([[0] * 5 + [1] * 7, [3] * 12])
    masked = teacher.targets(ids, pos, docs).hidden
    alone = teacher.targets(ids[:1, 5:], pos[:1, 5:]).hidden  # the second document on its own, same positions
    torch.testing.assert_close(masked[:1, 5:], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(masked[1:], teacher.targets(ids[1:], pos[1:]).hidden, rtol=1e-5, atol=1e-5)
    assert (masked[:1, 5:] - teacher.targets(ids[:1], pos[:1]).hidden[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("max_tokens", [1, 9, 0])
def test_hf_teacher_per_document_equals_a_dense_document_mask(make_hf_teacher, bpe_file, student_config, max_tokens):
    """Grouped, right-padded document runs give what HF gives under a (B, 1, T, T) document mask:
    one document per forward (1), several of mixed lengths padded together (9), the window (0)."""
    folder = make_hf_teacher(300, bpe_file)
    teacher = load_teacher(student_config(f"data.tokenizer={bpe_file}", f"distill.teacher={folder}",
                                          f"distill.teacher_tokens={max_tokens}"))
    ids, pos = _ids(300, T=16, seed=2)
    docs = torch.tensor([[0] * 3 + [1] * 6 + [2] * 2 + [3] * 5, [4] * 9 + [5] * 7])
    allowed = torch.ones(16, 16, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        dense = hf.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(teacher.targets(ids, pos, docs).hidden, dense, rtol=1e-5, atol=1e-5)


def test_ropelab_teacher_from_run_and_checkpoint(make_ropelab_teacher, student_config):
    from ropelab.sources import load

    run = make_ropelab_teacher()
    model, _, _ = load(run)
    ids, pos = _ids(259)
    with torch.no_grad():
        expected = model(ids, position_ids=pos)[0][..., :259]  # bytes: 259 tokens, rows padded to 320
    for source in (run, run / "checkpoints" / "step_00000003"):
        teacher = load_teacher(student_config(f"distill.teacher={source}"))
        assert teacher.info.source.is_ropelab and teacher.weight.shape[0] == 259
        got = teacher.targets(ids, pos).logits(torch.arange(ids.numel())).view(2, 12, 259)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the student's autocast does not reach the teacher
        assert teacher.targets(ids, pos).hidden.dtype == torch.float32


def test_ropelab_export_teaches_with_ropelab_classes(tmp_path, bpe_file, student_config):
    """A folder ropelab exported with its own modeling code (partial RoPE: no native class) is read as a
    ropelab model: no trust_remote_code, none of its shipped code run, the run's logits."""
    from ropelab.config import build_run_config
    from ropelab.export.hf import export_hf
    from ropelab.model import Transformer
    from ropelab.sources import load
    from ropelab.sources.imported import save_weights_only

    config = build_run_config(overrides=["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_ff=64",
                                         "model.vocab_size=320", f"data.tokenizer={bpe_file}", "data.seq_len=16",
                                         "model.rope.fraction=0.5"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config.to_yaml())
    torch.manual_seed(0)
    save_weights_only(run, 3, Transformer(config.model), config)
    folder = tmp_path / "hf"
    assert export_hf(run, folder)["route"] == "remote_code"
    (folder / "modeling_ropelab.py").write_text("raise SystemExit('the shipped modeling code ran')\n")

    teacher = load_teacher(student_config(f"data.tokenizer={bpe_file}", f"distill.teacher={folder}"))
    assert teacher.info.source.kind == "export" and teacher.weight.shape[0] == 300
    ids, pos = _ids(300)
    with torch.no_grad():
        expected = load(run).model(ids, position_ids=pos)[0][..., :300]
    got = teacher.targets(ids, pos).logits(torch.arange(ids.numel())).view(2, 12, 300)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_tokenizer_mismatch_is_refused(make_hf_teacher, make_ropelab_teacher, bpe_file, student_config):
    hf = make_hf_teacher(320, bpe_file)
    with pytest.raises(ConfigError, match=r"tokenizer .*300 tokens.* not the student's data.tokenizer='bytes' \(259"):
        check_teacher(student_config(f"distill.teacher={hf}"))  # student: bytes
    run = make_ropelab_teacher()
    with pytest.raises(ConfigError, match="not the student's data.tokenizer="):
        check_teacher(student_config(f"data.tokenizer={bpe_file}", f"distill.teacher={run}"))


def test_fewer_rows_than_tokens_and_missing_tokenizer_are_refused(make_hf_teacher, bpe_file, student_config):
    small = make_hf_teacher(280, bpe_file)
    with pytest.raises(ConfigError, match="280 rows but the tokenizer has 300 tokens"):
        check_teacher(student_config(f"data.tokenizer={bpe_file}", f"distill.teacher={small}"))
    bare = make_hf_teacher(300)
    with pytest.raises(ConfigError, match="no tokenizer files"):
        check_teacher(student_config(f"data.tokenizer={bpe_file}", f"distill.teacher={bare}"))


def test_missing_teacher_and_bad_settings_fail_before_work(tmp_path, make_ropelab_teacher, student_config):
    with pytest.raises(ConfigError, match="no such file or directory") as err:
        check_teacher(student_config(f"distill.teacher={tmp_path / 'nope'}"))
    assert "\n" not in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a ropelab run directory .* a Hugging Face model folder"):
        check_teacher(student_config(f"distill.teacher={tmp_path / 'empty'}"))
    run = make_ropelab_teacher()
    with pytest.raises(ConfigError, match=r"distill.top_k=260: larger than the vocabulary \(259 tokens\)"):
        check_teacher(student_config(f"distill.teacher={run}", "distill.top_k=260"))
    with pytest.raises(ConfigError, match=r"distill.temperature=0.0: must be in \[0.01, 100\]"):
        student_config(f"distill.teacher={run}", "distill.temperature=0")
    with pytest.raises(ConfigError, match="distill.teacher: required"):
        student_config("distill.alpha=0.5")


def test_a_student_initialised_from_a_model_of_another_vocabulary_is_refused(make_hf_teacher, make_ropelab_teacher,
                                                                             bpe_file, tmp_path, capsys):
    """The student starts from a bytes-level run (its tokenizer becomes the student's); the teacher speaks
    a 300-token BPE: one line naming distill.teacher, exit 2, nothing written."""
    from ropelab.cli import main

    source, teacher = make_ropelab_teacher(), make_hf_teacher(320, bpe_file)
    out = tmp_path / "student"
    assert main(["distill", "--out", str(out), f"train.init_from={source}", f"distill.teacher={teacher}",
                 "train.steps=2", "data.seq_len=16", "train.micro_batch=2"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the teacher's own save progress bar
    assert "distill.teacher=" in error and "not the student's data.tokenizer" in error and not out.exists()
