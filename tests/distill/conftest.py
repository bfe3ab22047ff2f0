"""Tiny teachers for the distillation tests: ropelab runs and Hugging Face folders, made locally."""

from __future__ import annotations

import pytest
import torch

from ropelab.config import build_run_config

STUDENT = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.n_kv_head=1", "model.d_ff=64",
           "data.seq_len=16", "train.micro_batch=2", "train.steps=2", "train.progress=false"]
TEXTS = [
    "def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "for i in range(10):\n    print(i * i)\n", "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
] * 4


@pytest.fixture
def student_args():
    """The tiny student's overrides, for command lines."""
    return list(STUDENT)


@pytest.fixture(scope="session")
def student_config():
    """student_config(*overrides) -> a validated tiny student RunConfig (bytes tokenizer unless overridden)."""
    return lambda *overrides: build_run_config(overrides=[*STUDENT, *overrides])


@pytest.fixture(scope="session")
def bpe_file(tmp_path_factory):
    """A 300-token byte-level BPE saved as tokenizer.json (the student's data.tokenizer)."""
    from ropelab.data.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe(TEXTS, 300).save(str(path))
    return path


@pytest.fixture(scope="session")
def make_hf_teacher(tmp_path_factory):
    """make(rows, tokenizer_file or None, seed) -> a saved LlamaForCausalLM folder with that tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    def make(rows: int, tokenizer_file=None, seed: int = 0):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
        folder = tmp_path_factory.mktemp("hf_teacher")
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        if tokenizer_file is not None:
            fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_file)),
                                                        eos_token="<|endoftext|>")
            fast.save_pretrained(folder)
        return folder

    return make


@pytest.fixture(scope="session")
def make_ropelab_teacher(tmp_path_factory):
    """make(tokenizer, seed, vocab) -> a ropelab run folder (config.yaml + one complete checkpoint),
    made once per session for each argument set: tests only read it."""
    from functools import cache

    from ropelab.sources.imported import save_weights_only
    from ropelab.model import Transformer

    @cache
    def make(tokenizer: str = "bytes", seed: int = 0, vocab: int = 320):
        config = build_run_config(overrides=[
            "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.d_ff=64", f"model.vocab_size={vocab}",
            f"data.tokenizer={tokenizer}", "data.seq_len=16"])
        run_dir = tmp_path_factory.mktemp("ropelab_teacher") / "run"
        run_dir.mkdir()
        (run_dir / "config.yaml").write_text(config.to_yaml())
        torch.manual_seed(seed)
        model = Transformer(config.model)
        with torch.no_grad():  # weights far from init, so that the teacher's distributions are peaked
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.3)
        save_weights_only(run_dir, 3, model, config)
        return run_dir

    return make


@pytest.fixture(scope="session")
def teacher_run(make_ropelab_teacher):
    """The default ropelab teacher: bytes tokenizer, 320 output rows."""
    return make_ropelab_teacher()
