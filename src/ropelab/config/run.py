"""The run-level configuration: data, attention, training phases, optimiser and schedule, distillation,
and `RunConfig`, which gathers them with the model's."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml

from ropelab.config.checks import FLOAT32_TINY, SEED_MAX, TOKENS_MAX, check_float, check_ints
from ropelab.config.model import ModelConfig
from ropelab.errors import ConfigError, quoted


# ----------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Where tokens come from and how they are packed into windows.

    `corpus`: ``stdlib``, ``stdlib-prose``, ``wiki-prose`` or ``shakespeare`` (the built-in corpora:
    standard-library source, its docstrings and comments, English Wikipedia lead sections, also
    ``wiki-prose-fr`` and ``wiki-prose-es``, or Shakespeare's plays, one long document each; tokenized on
    first use) or a folder written by ``ropelab data prepare``
    (its own validation split; `val_percent` applies to the built-in corpora only).
    `pack`: ``cross`` cuts the token stream every `seq_len` tokens, documents running across
    window edges; ``whole`` keeps documents whole, padding the rest of a window (no loss on
    padding) and cutting documents longer than `seq_len` into pieces.
    `mask_boundary_labels`: no loss on a document's last token, whose target is the next
    document's first. `positions`: ``running`` over the window, or ``restart`` at each document.
    `max_doc_len`: cut documents into pieces of at most this many tokens, each treated as a document
    (short documents from any corpus; see `ropelab.data.loader`). `piece_order`: ``stream`` keeps the
    pieces in the split's order; ``apart`` (training split, ``pack=cross``, needs `max_doc_len`) lays two
    pieces of one document at least a window apart, so no training window holds more than `max_doc_len`
    tokens of any document (`ropelab.data.pieces`).
    `copy_span` (training windows only; ``pack=cross``, no `max_doc_len`): in a share `copy_share` of
    the windows, a span of this many tokens is copied from a random place to a random later one, so the
    data rewards finding and continuing far context (the induction mechanism that retrieval measures);
    validation windows stay as they are.
    `verify` (prepared folders): ``once`` hashes the shards on first use on this machine,
    ``always`` at every start, ``sizes`` only checks file sizes.
    """

    corpus: str = "stdlib"  # "stdlib", "stdlib-prose", "wiki-prose", "shakespeare", or a prepared shard folder
    tokenizer: str = "bytes"  # "bytes", "bpe:<vocab>", or an HF tokenizer name / path
    seq_len: int = 256
    positions: Literal["running", "restart"] = "running"  # restart: position ids reset at each document
    val_percent: float = 2.0  # share of built-in documents held out for validation (stable hash of path or title)
    pack: Literal["cross", "whole"] = "cross"
    mask_boundary_labels: bool = False
    verify: Literal["once", "always", "sizes"] = "once"
    max_doc_len: Optional[int] = None
    piece_order: Literal["stream", "apart"] = "stream"
    copy_span: Optional[int] = None  # tokens copied to a later place in a training window
    copy_share: float = 0.5  # of the training windows, with copy_span

    def validate(self) -> None:
        check_ints("data", self, ("seq_len", "max_doc_len", "copy_span"))
        if self.copy_span is not None:
            if self.pack != "cross" or self.max_doc_len:
                raise ConfigError("data.copy_span: needs data.pack=cross and no data.max_doc_len (a copied span "
                                  "would carry a document's tokens into another piece)")
            if 2 * self.copy_span >= self.seq_len:
                raise ConfigError(f"data.copy_span={self.copy_span}: the span and its copy must fit in one window: "
                                  f"below data.seq_len / 2 = {self.seq_len / 2:g}")
        if isinstance(self.copy_share, bool) or not 0 < self.copy_share <= 1:
            raise ConfigError(f"data.copy_share={self.copy_share}: must be in (0, 1]")
        if self.piece_order == "apart" and (not self.max_doc_len or self.pack != "cross"):
            raise ConfigError("data.piece_order=apart: needs data.max_doc_len (the pieces' length) and data.pack=cross")
        if not (0 < self.val_percent < 50):
            raise ConfigError(f"data.val_percent={self.val_percent}: must be in (0, 50)")
        if not self.corpus:
            raise ConfigError("data.corpus: empty; use 'stdlib' or a folder written by `ropelab data prepare`")


# ------------------------------------------------------------------------ attention


@dataclass
class AttentionConfig:
    """`doc_mask`: forbid attention across documents in a packed window. `backend`: ``auto``
    (no mask: sdpa; with one: flex on CUDA, varlen elsewhere), ``sdpa`` (never masks), ``dense``
    (boolean T x T mask, the reference), ``varlen`` (cost follows the squared document lengths)
    or ``flex`` (FlexAttention block mask)."""

    backend: Literal["auto", "sdpa", "dense", "varlen", "flex"] = "auto"
    doc_mask: bool = False


# ------------------------------------------------------------------------- training


@dataclass
class PhaseConfig:
    """One stage of a multi-phase run (e.g. the distillation seed's short-context phase, then the
    long-context one). `overrides` are dotted keys applied to the run's config for this phase:
    data.*, attention.*, train.* (optimiser and schedule; the LR schedule restarts at each phase),
    model.rope.theta, model.rope.scaling (and its sub-keys: switch context extension on, or change its
    factor), the same two of a layer kind (model.layer_kinds.G.rope.theta) and model.max_seq_len. Weights
    and optimizer state carry over."""

    name: str = ""
    steps: Optional[int] = None
    tokens: Optional[int] = None  # alternative to steps: rounded up to whole optimizer steps
    overrides: dict = field(default_factory=dict)

    FIXED_KEYS = ("seed", "train.steps", "train.phases", "train.parallel", "train.device", "train.data_parallel",
                  "data.tokenizer", "distill.teacher")
    MODEL_KEYS = ("model.rope.theta", "model.rope.scaling", "model.max_seq_len")

    def validate(self, key: str) -> None:
        if (self.steps is None) == (self.tokens is None):
            raise ConfigError(f"{key}: give exactly one of steps or tokens")
        check_ints(key, self, ("steps",))
        check_ints(key, self, ("tokens",), high=TOKENS_MAX)
        for name in self.overrides:
            allowed = name in self.MODEL_KEYS or name.startswith("model.rope.scaling.") or bool(
                re.fullmatch(r"model\.layer_kinds\.[^.]+\.rope\.(theta|scaling(\..+)?)", name))
            if name in self.FIXED_KEYS or (name.startswith("model.") and not allowed):
                raise ConfigError(
                    f"{key}.overrides.{name}: fixed for the whole run; a phase may change data.*, attention.*, "
                    f"train.* (optimiser and schedule) and {', '.join(self.MODEL_KEYS)} (and its sub-keys; "
                    "a layer kind's rope.theta and rope.scaling too)"
                )

    def check_layer_kinds(self, key: str, pattern: Optional[str]) -> None:
        """Each layer kind the overrides name (``model.layer_kinds.G.rope.theta``) is one of `pattern`'s
        (kinds are case-sensitive: a ``g`` would be a new kind no layer has, changing nothing)."""
        kinds = sorted(set(pattern or ""))
        for name in self.overrides:
            match = re.fullmatch(r"model\.layer_kinds\.([^.]+)\..+", name)
            if match and match[1] not in kinds:
                has = f"its kinds are {', '.join(kinds)}; kinds are case-sensitive" if kinds else "none is set"
                raise ConfigError(f"{key}.overrides.{name}: layer kind {quoted(match[1])} is not in model.layer_pattern "
                                  f"({has})")


@dataclass
class TrainConfig:
    """Optimiser, schedule and bookkeeping. Defaults follow the partial-RoPE seed's released
    GPT-NeoX configs (AdamW 0.9/0.95, eps 1e-8, wd 0.1, lr 4e-4, 5% warm-up, cosine to 10%,
    clip 1.0); the step count and batch are a CPU-sized default."""

    steps: int = 200  # with phases: the sum of the phases' steps (set by the trainer)
    micro_batch: int = 16
    grad_accum: int = 1
    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.05
    warmup_steps: Optional[int] = None  # set: the warm-up in steps, in place of warmup_fraction (a branch keeps its trunk's)
    # cosine: warm-up, then cosine decay to lr * min_lr_ratio; wsd (warmup-stable-decay): warm-up, constant
    # lr, then a decay of `decay_shape` to lr * min_lr_ratio over the last decay_fraction of the steps;
    # constant: warm-up, then lr to the end (a frontier's trunk: its cooldowns are branches)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.1
    decay_shape: Literal["1-sqrt", "linear"] = "1-sqrt"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # auto: bf16 autocast on CUDA, fp32 on CPU (CPUs without AVX512-BF16/AMX run bf16 matmuls ~20x slower)
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # bf16 on a CPU: native (PyTorch's bf16 kernels), fp32 (bf16-rounded operands through fp32 GEMMs,
    # the same arithmetic; see ropelab.precision), auto (fp32 where the CPU has no bf16 instructions)
    bf16_gemm: Literal["auto", "native", "fp32"] = "auto"
    device: str = "auto"  # auto, cpu, cuda, cuda:1, ...
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 1
    compile: bool = False
    # Recompute activations in backward instead of keeping them: none, mlp (each block's norm + MLP) or
    # full (each whole block); less memory for more time (BENCHMARKS.md, "Real model")
    activation_checkpointing: Literal["none", "mlp", "full"] = "none"
    # CPU runs: glibc keeps freed tensor buffers for the next ones instead of returning them to the kernel,
    # which spares the page faults of paging them in again (`ropelab.allocator`)
    reuse_freed_memory: bool = True
    progress: bool = True
    tensorboard: bool = True  # event files in <run>/tensorboard when the tensorboard package is installed
    # Data-parallel ranks the run is planned for (None: the launched world size). The global
    # batch is micro_batch * grad_accum * data_parallel.
    data_parallel: Optional[int] = None
    parallel: Literal["ddp", "fsdp"] = "ddp"  # fsdp: FSDP2 fully_shard (weights, grads, optimizer sharded)
    # Checkpoints that also hold model.safetensors (the gathered weights): every one, or phase ends and
    # the last step only (the others load from their dcp/ shards); auto: boundaries under fsdp
    full_weights: Literal["auto", "every", "boundaries"] = "auto"
    max_bad_steps: int = 5  # consecutive skipped (non-finite or spiking) steps before the run stops
    spike_factor: Optional[float] = None  # skip a step whose loss exceeds this x the median of recent steps
    spike_window: int = 50
    z_loss: float = 0.0  # PaLM's auxiliary loss z * logsumexp(logits)^2 (keeps logits from drifting)
    phases: list[PhaseConfig] = field(default_factory=list)
    # A model source (run, checkpoint, imported or HF folder, hub name, GGUF file, built-in name) whose
    # weights start the run, with a fresh optimizer and schedule (see `ropelab.sources.init`)
    init_from: Optional[str] = None
    # With init_from: the source layers the run's layers start from, in order (a depth-pruned student,
    # e.g. every third of 30: [0, 3, ..., 27]); empty: all of them. model.n_layer follows its length.
    init_layers: list[int] = field(default_factory=list)
    # A run (its newest checkpoint, or the one at branch_step) or a checkpoint folder whose full training
    # state this run continues: weights, optimizer moments, step count, data position and RNG; the
    # schedule is this run's own, and steps count on from the checkpoint's (`ropelab.train.branch`)
    branch_from: Optional[str] = None
    branch_step: Optional[int] = None
    # Steps whose checkpoints are written and kept for good (the points a study branches from)
    checkpoint_steps: list[int] = field(default_factory=list)
    # Checksums of every file a checkpoint load reads (always), or their sizes only (cheap; see
    # `ropelab.train.integrity` for the measured cost per GB)
    verify_checkpoints: Literal["always", "sizes"] = "always"
    # With init_from a full-RoPE source and a 2-norm plan in model.rope: tokens of the run's training data
    # whose query/key pair norms choose the pairs (MHA2MLA's calibration)
    calibration_tokens: int = 65_536

    def validate(self) -> None:
        if self.steps < 0 or (self.steps == 0 and not self.init_from) or (self.steps == 0 and self.phases):
            raise ConfigError(f"train.steps={self.steps}: must be > 0 (0 only with train.init_from and no phases: "
                              "the source's weights, converted where the run asks, are evaluated and saved)")
        check_ints("train", self, ("steps", "warmup_steps", "branch_step"), low=0)
        check_ints("train", self, ("micro_batch", "grad_accum", "eval_every", "eval_batches", "checkpoint_every",
                                   "keep_checkpoints", "log_every", "max_bad_steps", "spike_window", "data_parallel"))
        check_ints("train", self, ("calibration_tokens",), high=TOKENS_MAX)
        check_float("train.lr", self.lr, "(0, 1]", "AdamW moves every weight by about lr per step")
        check_float("train.weight_decay", self.weight_decay, "[0, inf)")
        if self.lr * self.weight_decay >= 1:
            raise ConfigError(f"train.weight_decay={self.weight_decay}: must be < 1 / train.lr = {1 / self.lr:g} "
                              "(each step scales the weights by 1 - lr * weight_decay)")
        for name in ("beta1", "beta2"):
            check_float(f"train.{name}", getattr(self, name), "[0, 1)")
        check_float("train.eps", self.eps, f"[{FLOAT32_TINY!r}, inf)", "AdamW divides by sqrt(v) + eps, and v is 0 "
                    "where no gradient reached; a smaller eps is 0 in float32")
        check_float("train.grad_clip", self.grad_clip, "(0, inf)", "the gradient norm above which gradients are scaled down")
        if not (0 <= self.min_lr_ratio <= 1):
            raise ConfigError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if not (0 <= self.warmup_fraction < 1):
            raise ConfigError(f"train.warmup_fraction={self.warmup_fraction}: must be in [0, 1)")
        if self.warmup_steps is not None and not (0 <= self.warmup_steps < max(self.steps, 1)):
            raise ConfigError(f"train.warmup_steps={self.warmup_steps}: must be in [0, train.steps={self.steps})")
        if self.init_layers and self.init_from is None:
            raise ConfigError(f"train.init_layers={self.init_layers}: needs train.init_from (the model whose layers "
                              "the run starts from)")
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.init_layers):
            raise ConfigError(f"train.init_layers={self.init_layers}: must be a list of layer indices (integers >= 0)")
        if self.branch_from is not None and self.init_from is not None:
            raise ConfigError("train.branch_from and train.init_from: give one (a branch continues a run's whole "
                              "training state; init_from takes only weights)")
        if self.branch_step is not None and (self.branch_from is None or self.branch_step < 0):
            raise ConfigError(f"train.branch_step={self.branch_step}: needs train.branch_from and must be >= 0")
        for i, step in enumerate(self.checkpoint_steps):
            if not 0 < step <= self.steps:
                raise ConfigError(f"train.checkpoint_steps[{i}]={step}: must be in [1, train.steps={self.steps}]")
        if not (0 < self.decay_fraction <= 1):
            raise ConfigError(f"train.decay_fraction={self.decay_fraction}: must be in (0, 1]")
        warmup = self.warmup_fraction if self.warmup_steps is None else self.warmup_steps / max(self.steps, 1)
        if self.schedule == "wsd" and warmup + self.decay_fraction > 1 + 1e-12:
            raise ConfigError(f"train.decay_fraction={self.decay_fraction}: with a warm-up of {warmup:g} of the "
                              "steps, warm-up and decay exceed the run (their sum must be <= 1)")
        if self.spike_factor is not None:
            check_float("train.spike_factor", self.spike_factor, "(1, inf)")
        check_float("train.z_loss", self.z_loss, "[0, 1]", "a weight above 1 outweighs the loss it steadies; PaLM uses 1e-4")
        names = [p.name for p in self.phases]
        for i, phase in enumerate(self.phases):
            phase.validate(f"train.phases[{i}]")
        if len(set(names)) != len(names):
            raise ConfigError(f"train.phases: names must be distinct, got {names}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * (self.data_parallel or 1)


# --------------------------------------------------------------------------- distill


@dataclass
class DistillConfig:
    """Logit knowledge distillation from a frozen teacher (the "Short Data, Long Context" seed's
    setup: forward KL on the teacher's logits in place of, or mixed with, cross-entropy).

    loss = alpha * T^2 * KL(p_teacher^T || p_student^T) + (1 - alpha) * CE, per non-ignored token;
    alpha = 1 is pure KD as in the seed. `top_k` keeps the teacher's k most likely ids plus one
    "rest" bucket (see `ropelab.train.loss`). `teacher` is a Hugging Face causal LM (hub name or
    local folder) or a ropelab run / checkpoint folder; `logits_cache` is a folder written by
    `ropelab distill --cache` (offline KD: the teacher is not loaded). The teacher must share the
    student's tokenizer. Positions without a label (-100: padding, and document boundaries with
    `data.mask_boundary_labels`) count in neither KD nor CE."""

    teacher: str = ""
    temperature: float = 1.0
    alpha: float = 1.0  # weight of KD; 1 - alpha weighs cross-entropy
    top_k: Optional[int] = None  # None: the full vocabulary
    chunk_tokens: int = 4096  # tokens per chunk of the loss: with a teacher it holds about six fp32 (chunk x vocab) tensors
    teacher_device: str = "auto"  # auto: the student's device
    teacher_precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    # HF teacher under a document mask: padded tokens per forward when documents run separately
    # (0: the window length)
    teacher_tokens: int = 0
    logits_cache: Optional[str] = None

    def validate(self) -> None:
        if not self.teacher and not self.logits_cache:
            raise ConfigError("distill.teacher: required (a Hugging Face model name or folder, or a ropelab run), "
                              "or set distill.logits_cache")
        check_float("distill.temperature", self.temperature, "[0.01, 100]", "beyond, the softened distributions are "
                    "one-hot or uniform in float32, and the loss is scaled by its square")
        if not (0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"distill.alpha={self.alpha}: must be in [0, 1] (1 = pure KD, 0 = pure cross-entropy)")
        check_ints("distill", self, ("top_k", "chunk_tokens"))
        check_ints("distill", self, ("teacher_tokens",), low=0)


# ------------------------------------------------------------------------------ run


@dataclass
class RunConfig:
    seed: int = 0
    model: ModelConfig = field(default_factory=lambda: ModelConfig.from_name("tiny-llama"))
    data: DataConfig = field(default_factory=DataConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distill: Optional[DistillConfig] = None  # set: train by knowledge distillation

    def validate(self) -> "RunConfig":
        check_ints("", self, ("seed",), low=0, high=SEED_MAX)
        self.model.validate()
        self.data.validate()
        self.train.validate()
        for i, phase in enumerate(self.train.phases):
            phase.check_layer_kinds(f"train.phases[{i}]", self.model.layer_pattern)
        if self.distill is not None:
            self.distill.validate()
            top_k, vocab = self.distill.top_k, self.model.vocab_size
            if top_k is not None and vocab is not None and top_k > vocab:
                raise ConfigError(f"distill.top_k={top_k}: must be <= model.vocab_size={vocab}")
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len}: longer than model.max_seq_len={self.model.max_seq_len}"
            )
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
