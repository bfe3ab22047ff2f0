"""The frozen teacher of a distillation run: a Hugging Face causal LM or a ropelab run.

  check_teacher(config)          finds the teacher and checks it against the student's tokenizer,
                                 reading only configs and tokenizers (no weights): the CLI calls it
                                 before any work, `load_teacher` calls it first
  load_teacher(config, device)   -> Teacher, in eval mode without gradients, bf16 on CUDA by default
Both take `trust_remote_code` (default False): whether transformers may run Python code shipped
with a Hugging Face teacher or its tokenizer.
  Teacher.targets(...)           -> `TeacherHidden`: final hidden states + output head, so that
                                 `kd_loss` makes the teacher's logits one chunk of tokens at a time

`distill.teacher` is any model source (`ropelab.sources.resolve`): a ropelab run or checkpoint, a
GGUF file or built-in name (imported once into the cache, then a ropelab model), a folder ropelab
exported with its own modeling code (read as a ropelab model), or a Hugging Face model folder or hub
name, run natively by transformers (`AutoModelForCausalLM`; hidden states from
`get_decoder()`, the head from `get_output_embeddings()`), so any causal LM can teach.

Vocabulary. The teacher must use the student's tokenizer: the same fingerprint, or the same
token -> id table. Embedding rows beyond the tokenizer's size are padding (ropelab pads to a
multiple of 64, many HF models too): the teacher's head is cut to the tokenizer's ids, and student
rows beyond them receive zero teacher probability (see `ropelab.train.loss`). A teacher with fewer
rows than the tokenizer, or another tokenizer, is refused.

Document mask. Given document ids, a ropelab teacher uses its own attention backends. An HF teacher
runs each document (each run of equal ids in a row) on its own, at its own position ids, which is
what the mask means: `per_document`. Documents of similar length share a forward, right-padded (a
causal model's outputs before the padding do not depend on it), at most `distill.teacher_tokens`
tokens per forward, so the cost follows the sum of squared document lengths, with no T x T mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ropelab import sources
from ropelab.attention import Documents
from ropelab.config import ConfigError, RunConfig
from ropelab.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer
from ropelab.sources import Source, hf_models
from ropelab.train.loss import TeacherHidden

# Attributes of HF configs whose models transform the logits after the output head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class TeacherInfo:
    source: Source  # a ropelab run, checkpoint or export (GGUF files are imported), or a model transformers runs
    rows: int  # the teacher's output rows (embedding size, padding included)
    vocab: int  # ids of the shared tokenizer: the teacher logits KD uses


def _teacher_error(teacher: str, why: str) -> ConfigError:
    return ConfigError(f"distill.teacher={teacher!r}: {why}")


def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    if a.fingerprint() == b.fingerprint():
        return True
    return isinstance(a, HFTokenizer) and isinstance(b, HFTokenizer) and (
        a.tok.get_vocab(with_added_tokens=True) == b.tok.get_vocab(with_added_tokens=True)
    )


def _student_tokenizer(config: RunConfig) -> Tokenizer:
    d = config.data
    return load_tokenizer(d.tokenizer, d.corpus, d.val_percent)


def _locate(config: RunConfig, trust_remote_code: bool) -> tuple[Source, int, Tokenizer]:
    """(source, output rows, tokenizer) of the teacher, without loading weights."""
    name = config.distill.teacher
    try:
        source = sources.resolve(name, trust_remote_code)
        if source.kind != "hf":  # a ropelab run, checkpoint or export, or a GGUF file (imported into the cache)
            teacher_config, source = sources.load_config(source)
            d = teacher_config.data
            return source, teacher_config.model.vocab_size, load_tokenizer(d.tokenizer, d.corpus, d.val_percent)
        rows = hf_models.hf_text_config(source).vocab_size
        if not hf_models.has_tokenizer_files(source):
            raise ConfigError("has no tokenizer files, so it cannot be checked against the student's; "
                              "use the ropelab run it came from as the teacher, or save its tokenizer there")
        return source, rows, hf_models.hf_tokenizer(source)
    except ConfigError as exc:
        raise _teacher_error(name, str(exc).removeprefix(f"{Path(name).expanduser()}: ")) from None


def check_teacher(config: RunConfig, trust_remote_code: bool = False) -> TeacherInfo:
    """Find `config.distill.teacher` and check it against the student: same tokenizer, enough
    output rows, `distill.top_k` within the vocabulary. ConfigError (one line) otherwise."""
    distill = config.distill
    if distill is None or not distill.teacher:
        raise ConfigError("distill.teacher: not set (a Hugging Face model name or folder, or a ropelab run)")
    source, rows, tokenizer = _locate(config, trust_remote_code)
    student = _student_tokenizer(config)
    if not _same_tokenizer(tokenizer, student):
        raise _teacher_error(distill.teacher, (
            f"its tokenizer ({tokenizer.name}, {tokenizer.vocab_size} tokens) is not the student's "
            f"data.tokenizer={config.data.tokenizer!r} ({student.vocab_size} tokens); KD needs the same token ids"))
    if rows < student.vocab_size:
        raise _teacher_error(distill.teacher, (
            f"its output has {rows} rows but the tokenizer has {student.vocab_size} tokens; not a model of this tokenizer"))
    if distill.top_k is not None and distill.top_k > student.vocab_size:
        raise ConfigError(f"distill.top_k={distill.top_k}: larger than the vocabulary ({student.vocab_size} tokens)")
    return TeacherInfo(source, rows, student.vocab_size)


class Teacher:
    """A frozen model seen through `hidden_fn(input_ids, position_ids, doc_ids) -> (B, T, C_t)` and
    its output head, cut to the shared vocabulary."""

    def __init__(self, hidden_fn: Callable, head: nn.Linear, info: TeacherInfo, device: torch.device,
                 module: nn.Module):
        self.hidden_fn = hidden_fn
        self.weight = head.weight[: info.vocab]
        self.bias = None if head.bias is None else head.bias[: info.vocab]
        self.info = info
        self.device = device
        self.module = module  # kept for inspection; always in eval mode without gradients
        self._heads: dict[torch.device, tuple] = {}

    def _head_on(self, device: torch.device) -> tuple:
        """The head's weight and bias on `device`, copied once per device."""
        if device == self.device:
            return self.weight, self.bias
        if device not in self._heads:
            self._heads[device] = tuple(None if t is None else t.to(device) for t in (self.weight, self.bias))
        return self._heads[device]

    @torch.no_grad()
    def targets(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                out_device: Optional[torch.device] = None) -> TeacherHidden:
        """The teacher's final hidden states for a batch, with its head, on `out_device` (default: the
        teacher's). Runs in the teacher's own precision, outside any autocast of the student's."""
        to = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        with torch.autocast(self.device.type, enabled=False):
            hidden = self.hidden_fn(to(input_ids), to(position_ids), to(doc_ids))
        out_device = torch.device(out_device) if out_device is not None else self.device
        weight, bias = self._head_on(out_device)
        return TeacherHidden(hidden.to(out_device), weight, bias)


def teacher_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def per_document(run: Callable, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor,
                 max_tokens: int) -> torch.Tensor:
    """`run(input_ids, position_ids) -> (n, L, C)` applied to every document of a packed (B, T) batch
    separately: documents sorted by length, the longest first, batched up to `max_tokens` padded
    tokens (at least one document), right-padded with their last token and position. -> (B, T, C)."""
    B, T = input_ids.shape
    starts, lengths = Documents(doc_ids).segments()
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    starts, lengths = starts.tolist(), lengths.tolist()
    flat_ids, flat_pos = input_ids.reshape(-1), position_ids.reshape(-1)
    out = None
    i = 0
    while i < len(order):
        width = lengths[order[i]]
        group = order[i: i + max(1, max_tokens // width)]
        i += len(group)
        # (n, width) gather indices: each document's tokens, then its last token repeated
        index = torch.stack([starts[d] + torch.arange(width).clamp(max=lengths[d] - 1) for d in group]).to(flat_ids.device)
        hidden = run(flat_ids[index], flat_pos[index])
        if out is None:
            out = hidden.new_empty(B * T, hidden.shape[-1])
        for row, d in enumerate(group):
            out[starts[d]: starts[d] + lengths[d]] = hidden[row, : lengths[d]]
    return out.view(B, T, -1)


def _load_ropelab(info: TeacherInfo, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, Callable, nn.Linear]:
    model, _, config = sources.load(info.source)
    model = model.to(device=device, dtype=dtype).requires_grad_(False)
    model.set_attention_backend(config.attention.backend)
    return model, model.hidden_states, model.lm_head


def _load_hf(info: TeacherInfo, device: torch.device, dtype: torch.dtype, name: str,
             max_tokens: int) -> tuple[nn.Module, Callable, nn.Linear]:
    try:
        model = hf_models.load_hf_model(info.source, dtype)
    except ConfigError as exc:
        raise _teacher_error(name, str(exc)) from None
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attr in _LOGIT_TRANSFORMS:
        if getattr(text_config, attr, None) not in (None, 1, 1.0):
            raise _teacher_error(name, f"{type(model).__name__} transforms its logits after the head ({attr}); "
                                       "not supported as a teacher")
    model = model.to(device).eval().requires_grad_(False)
    decoder = model.get_decoder()

    def run(input_ids, position_ids):
        return decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state

    def hidden(input_ids, position_ids, doc_ids):
        if doc_ids is None:
            return run(input_ids, position_ids)
        return per_document(run, input_ids, position_ids, doc_ids, max_tokens or input_ids.shape[1])

    return model, hidden, model.get_output_embeddings()


def _teacher_device(name: str, student_device: str | torch.device) -> torch.device:
    if name == "auto":
        return torch.device(student_device)
    key = f"distill.teacher_device={name!r}"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"{key}: CUDA is not available on this machine")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{key}: not a device (auto, cpu, cuda, cuda:1, ...)") from None


def load_teacher(config: RunConfig, device: str | torch.device = "cpu", trust_remote_code: bool = False) -> Teacher:
    """The teacher of `config.distill`, checked (`check_teacher`) and loaded on `distill.teacher_device`
    ("auto": `device`, the student's) in `distill.teacher_precision`."""
    distill = config.distill
    info = check_teacher(config, trust_remote_code)
    device = _teacher_device(distill.teacher_device, device)
    dtype = teacher_dtype(distill.teacher_precision, device)
    if info.source.kind == "hf":
        module, hidden_fn, head = _load_hf(info, device, dtype, distill.teacher, distill.teacher_tokens)
    else:
        module, hidden_fn, head = _load_ropelab(info, device, dtype)
    return Teacher(hidden_fn, head, info, device, module)


__all__ = ["Teacher", "TeacherInfo", "check_teacher", "load_teacher", "per_document", "teacher_dtype"]
