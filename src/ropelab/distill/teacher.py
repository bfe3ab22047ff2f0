"""The frozen teacher of a distillation run: a Hugging Face causal LM or a ropelab run.

  check_teacher(config)          finds the teacher and checks it against the student's tokenizer,
                                 reading only configs and tokenizers (no weights): the CLI calls it
                                 before any work, `load_teacher` calls it first
  load_teacher(config, device)   -> Teacher, in eval mode without gradients, bf16 on CUDA by default
  Teacher.targets(...)           -> `TeacherHidden`: final hidden states + output head, so that
                                 `kd_loss` makes the teacher's logits one chunk of tokens at a time

`distill.teacher` is read as a ropelab run directory or checkpoint folder (anything holding a
config.yaml, see `ropelab.evaluate.interchange.resolve_checkpoint`), else as a Hugging Face model
folder or hub name (`AutoModelForCausalLM`; hidden states from `get_decoder()`, the head from
`get_output_embeddings()`). When the hub is unreachable, hub names resolve from the local cache only,
so a missing model fails at once instead of retrying.

Vocabulary. The teacher must use the student's tokenizer: the same fingerprint, or the same
token -> id table. Embedding rows beyond the tokenizer's size are padding (ropelab pads to a
multiple of 64, many HF models too): the teacher's head is cut to the tokenizer's ids, and student
rows beyond them receive zero teacher probability (see `ropelab.distill.loss`). A teacher with fewer
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

from ropelab import hub
from ropelab.config import ConfigError, RunConfig
from ropelab.data.tokenizer import HFTokenizer, Tokenizer, load_hf_tokenizer, load_tokenizer
from ropelab.distill.loss import TeacherHidden

_HF_MARKERS = ("config.json",)
# Attributes of HF configs whose models transform the logits after the output head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass
class TeacherInfo:
    kind: str  # "ropelab" | "hf"
    source: str  # resolved folder, or the hub name
    rows: int  # the teacher's output rows (embedding size, padding included)
    vocab: int  # ids of the shared tokenizer: the teacher logits KD uses


def _is_ropelab(path: Path) -> bool:
    """A run (or imported) folder, or one of its checkpoints/step_N folders."""
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
    return (run_dir / "config.yaml").is_file()


def _teacher_error(teacher: str, why: str) -> ConfigError:
    return ConfigError(f"distill.teacher={teacher!r}: {why}")


def _hf_text_config(hf_config):
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    if a.fingerprint() == b.fingerprint():
        return True
    return isinstance(a, HFTokenizer) and isinstance(b, HFTokenizer) and (
        a.tok.get_vocab(with_added_tokens=True) == b.tok.get_vocab(with_added_tokens=True)
    )


def _student_tokenizer(config: RunConfig) -> Tokenizer:
    d = config.data
    return load_tokenizer(d.tokenizer, d.corpus, d.val_percent)


def _locate(config: RunConfig) -> tuple[str, str, int, Tokenizer]:
    """(kind, source, output rows, tokenizer) of the teacher, without loading weights."""
    from ropelab.evaluate.interchange import _is_local, resolve_checkpoint
    from ropelab.train.checkpoint import weights_vocab

    name = config.distill.teacher
    path = Path(name).expanduser()
    if path.exists() and _is_ropelab(path):
        from ropelab.train.loop import load_run_config

        run_dir, folder = resolve_checkpoint(path)
        teacher_config = load_run_config(run_dir)
        rows = teacher_config.model.vocab_size or weights_vocab(folder)
        d = teacher_config.data
        return "ropelab", str(folder), rows, load_tokenizer(d.tokenizer, d.corpus, d.val_percent)
    if _is_local(name) and not (path.is_dir() and any((path / m).is_file() for m in _HF_MARKERS)):
        why = "not a Hugging Face model folder (no config.json)" if path.is_dir() else "no such folder"
        raise _teacher_error(name, f"{why}; expected a ropelab run or checkpoint, an HF model folder, or a hub name "
                                   "like org/model")
    source = str(path) if _is_local(name) else name
    if not _is_local(name):
        hub.offline_unless_reachable()  # hub names then resolve from the local cache, at once
    try:
        from transformers import AutoConfig

        rows = _hf_text_config(AutoConfig.from_pretrained(source)).vocab_size
    except Exception as exc:  # noqa: BLE001 - missing repo, offline, bad folder: one line
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise _teacher_error(name, f"could not load its config ({type(exc).__name__}: {first})") from None
    has_files = not path.is_dir() or any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    if not has_files:
        raise _teacher_error(name, "has no tokenizer files, so it cannot be checked against the student's; "
                                   "use the ropelab run it came from as the teacher, or save its tokenizer there")
    try:
        tokenizer = load_hf_tokenizer(source)
    except ConfigError as exc:
        raise _teacher_error(name, f"its tokenizer: {exc}") from None
    return "hf", source, rows, tokenizer


def check_teacher(config: RunConfig) -> TeacherInfo:
    """Find `config.distill.teacher` and check it against the student: same tokenizer, enough
    output rows, `distill.top_k` within the vocabulary. ConfigError (one line) otherwise."""
    distill = config.distill
    if distill is None or not distill.teacher:
        raise ConfigError("distill.teacher: not set (a Hugging Face model name or folder, or a ropelab run)")
    kind, source, rows, tokenizer = _locate(config)
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
    return TeacherInfo(kind, source, rows, student.vocab_size)


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
    from ropelab.attention import Documents

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
    from ropelab.evaluate.interchange import load_model

    model, config = load_model(info.source)
    model = model.to(device=device, dtype=dtype).requires_grad_(False)
    model.set_attention_backend(config.attention.backend)
    return model, model.hidden_states, model.lm_head


def _load_hf(info: TeacherInfo, device: torch.device, dtype: torch.dtype, name: str,
             max_tokens: int) -> tuple[nn.Module, Callable, nn.Linear]:
    import transformers
    from packaging.version import Version

    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(info.source, **{dtype_key: dtype})
    except Exception as exc:  # noqa: BLE001 - one line for the user
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise _teacher_error(name, f"could not load a causal LM ({type(exc).__name__}: {first})") from None
    text_config = _hf_text_config(model.config)
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


def load_teacher(config: RunConfig, device: str | torch.device = "cpu") -> Teacher:
    """The teacher of `config.distill`, checked (`check_teacher`) and loaded on `distill.teacher_device`
    ("auto": `device`, the student's) in `distill.teacher_precision`."""
    distill = config.distill
    info = check_teacher(config)
    device = _teacher_device(distill.teacher_device, device)
    dtype = teacher_dtype(distill.teacher_precision, device)
    if info.kind == "ropelab":
        module, hidden_fn, head = _load_ropelab(info, device, dtype)
    else:
        module, hidden_fn, head = _load_hf(info, device, dtype, distill.teacher, distill.teacher_tokens)
    return Teacher(hidden_fn, head, info, device, module)


__all__ = ["Teacher", "TeacherInfo", "check_teacher", "load_teacher", "per_document", "teacher_dtype"]
