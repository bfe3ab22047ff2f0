"""SmolLM2-135M in ropelab and in Hugging Face transformers, and what each row of benchmarks/real_model.py runs.

Models. ropelab: `ropelab.sources.load("smollm2-135m")` (the GGUF file imported once into
$ROPELAB_CACHE/imports). HF: `ropelab.sources.hf_models.load_hf_model(resolve("smollm2-135m"))`,
i.e. transformers' own GGUF loader (dequantized to fp32, its default attention, sdpa). Same weights:
the run checks that both give the same logits on 64 tokens before timing. `--quick` builds SmolLM2's
shape (`SMOLLM2_SHAPE`, checked against the file on every real run) with 2 layers and random
weights, and the HF model from it with `ropelab.sources.hf.to_hf`; it needs no model file.

Rows (batch x tokens; `--quick`: 1 x 64, 1 x 256, 2 x 32):
  forward2k  1 x 2048, no grad, the full forward an LM runs to score a text: every position's logits
             (`model(ids)` for ropelab, `hf(ids)` for HF, as called; HF keeps its default
             `use_cache`, so it also fills a KV cache, as a caller of `hf(ids)` gets)
  forward8k  1 x 8192, the same
  train      4 x 512: forward with loss, backward, AdamW step, zero_grad. ropelab: the trainer's
             chunked cross-entropy objective (`cross_entropy_objective()`, never the full logits);
             HF: `hf(input_ids=ids, labels=ids).loss`. Both: `build_optimizer(model, TrainConfig())`
             (fused AdamW, its state allocated first as the trainer does), the same token ids, and
             the same targets (ropelab's labels are HF's shift: the next token, -100 at the end), so
             their first losses must agree. Every training row starts from the loaded weights
             (real_model.py restores them), so every row's first losses do.
  train-mlp  the same, ropelab with `train.activation_checkpointing=mlp` (each block's norm + MLP run
             again in backward); HF as in `train` (its default, no checkpointing)
  train-full the same with `full` (each whole block run again in backward)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from ropelab.config import ModelConfig, RopeConfig, TrainConfig
from ropelab.precision import mixed_precision

SOURCE = "smollm2-135m"
LIBRARIES = ("ropelab", "hf")
# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json); `--quick` builds it with 2 layers.
SMOLLM2_SHAPE = ModelConfig(name="smollm2-135m-shape", vocab_size=49152, n_layer=30, d_model=576, n_head=9,
                            n_kv_head=3, head_dim=64, d_ff=1536, norm_eps=1e-5, tie_embeddings=True,
                            max_seq_len=8192, rope=RopeConfig(fraction=1.0, theta=100000.0))
QUICK_LAYERS = 2
SHAPE_FIELDS = ("vocab_size", "n_layer", "d_model", "n_head", "n_kv_head", "head_dim", "d_ff", "tie_embeddings")


class Row(NamedTuple):
    kind: str  # "forward" or "train"
    batch: int
    seq: int
    quick_batch: int
    quick_seq: int
    checkpointing: str = "none"  # ropelab's train.activation_checkpointing in the row (HF: its default, none)


ROWS = {
    "forward2k": Row("forward", 1, 2048, 1, 64),
    "forward8k": Row("forward", 1, 8192, 1, 256),
    "train": Row("train", 4, 512, 2, 32),
    "train-mlp": Row("train", 4, 512, 2, 32, "mlp"),
    "train-full": Row("train", 4, 512, 2, 32, "full"),
}


def shape_of(row: Row, quick: bool) -> tuple[int, int]:
    return (row.quick_batch, row.quick_seq) if quick else (row.batch, row.seq)


# ------------------------------------------------------------------ models


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def quick_model():
    from ropelab.model import Transformer

    torch.manual_seed(0)
    return Transformer(dataclasses.replace(SMOLLM2_SHAPE, n_layer=QUICK_LAYERS))


def load_ropelab(quick: bool):
    if quick:
        return quick_model().eval()
    from ropelab.sources import load

    return load(SOURCE).model.eval()


def load_hf(quick: bool):
    """HF's model, as this process times it: transformers' GGUF import, or (quick) `to_hf` of the random model."""
    quiet_transformers()
    if quick:
        from ropelab.sources.hf import to_hf

        return to_hf(quick_model(), attn_implementation="sdpa").eval()
    from ropelab.sources import resolve
    from ropelab.sources.hf_models import load_hf_model

    return load_hf_model(resolve(SOURCE)).eval()


def save_hf(hf, folder: str) -> None:
    """What `load_hf_saved` rebuilds HF's model from: its config and its state dict (tied tensors stay tied)."""
    config = hf.config.to_dict()
    config.pop("quantization_config", None)  # the GGUF file's; the weights are dequantized fp32
    Path(folder, "config.json").write_text(json.dumps(config))
    torch.save(hf.state_dict(), Path(folder, "state.pt"))


def load_hf_saved(folder: str, attn_implementation: str):
    quiet_transformers()
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation=attn_implementation)
    state = torch.load(Path(folder, "state.pt"), mmap=True, weights_only=True)
    model.load_state_dict(state, strict=True)
    del state
    return model.eval()


def shape_mismatch(config: ModelConfig) -> list[str]:
    return [f"{name}: file {getattr(config, name)}, SMOLLM2_SHAPE {getattr(SMOLLM2_SHAPE, name)}"
            for name in SHAPE_FIELDS if getattr(config, name) != getattr(SMOLLM2_SHAPE, name)]


# ------------------------------------------------------------------ what a row runs


def token_ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch * 100003 + seq))


def make_run(library: str, model, row: Row, quick: bool, precision: str) -> Callable[[], Optional[float]]:
    """One call of the row for one library: a forward (returns None) or a training step (returns its loss).
    A training step's optimizer is created here, its state on the first step."""
    batch, seq = shape_of(row, quick)
    vocab = model.config.vocab_size
    ids = token_ids(batch, seq, vocab)
    bf16 = precision == "bf16"
    if row.kind == "forward":
        if library == "ropelab":
            def forward():
                model.eval()
                with torch.no_grad(), mixed_precision("cpu", bf16):
                    logits, _ = model(ids)
                del logits
        else:
            def forward():
                model.eval()
                with torch.no_grad(), mixed_precision("cpu", bf16):
                    out = model(ids)
                del out
        return forward

    from ropelab.train.optim import allocate_state, build_optimizer

    optimizer = build_optimizer(model, TrainConfig())
    allocate_state(optimizer)  # as the trainer does: the moments before the first step, for both libraries
    if library == "ropelab":
        model.set_activation_checkpointing(row.checkpointing)
        from ropelab.data.loader import Batch
        from ropelab.train.objectives import cross_entropy_objective

        labels = torch.cat([ids[:, 1:], torch.full((batch, 1), -100, dtype=ids.dtype)], dim=1)  # HF's shift
        positions = torch.arange(seq).expand(batch, seq)
        data = Batch(ids, labels, positions, torch.zeros_like(ids))
        objective = cross_entropy_objective()

        def loss_of():
            return objective(model, data)[0]
    else:
        def loss_of():
            return model(input_ids=ids, labels=ids).loss

    def step() -> float:
        model.train()
        with mixed_precision("cpu", bf16):
            loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step
