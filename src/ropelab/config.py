"""Typed configuration: dataclasses, named model presets, YAML and dotted overrides.

Every component owns a small dataclass; `RunConfig` gathers them. Loading goes
through `from_dict`, which rejects unknown keys and wrong types with a
`ConfigError` naming the dotted key, so a user mistake never becomes a
traceback.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from ropelab.config_checks import FLOAT32_TINY, SEED_MAX, TOKENS_MAX, check_float, check_ints, finite_number
from ropelab.errors import ConfigError


# ----------------------------------------------------------------------------- RoPE


def resolve_rotary_dims(head_dim: int, fraction: float = 1.0, rotary_dims: Optional[int] = None) -> int:
    """Number of rotated channels per head for a fraction or an explicit even count:
    ``2 * floor(fraction * head_dim / 2)``, at least 2 for any fraction > 0."""
    if rotary_dims is not None:
        return int(rotary_dims)
    if fraction <= 0:
        return 0
    return max(2, 2 * math.floor(fraction * head_dim / 2 + 1e-9))


SCALING_METHODS = ("linear", "ntk", "dynamic", "yarn", "llama3", "longrope")


@dataclass
class RopeScalingConfig:
    """Context extension of one layer's RoPE (`model.rope.scaling`), as transformers' rope types
    compute it, on exactly the layer's rotated pairs (see `ropelab.rope_scaling` for the math):

      - ``linear`` (position interpolation): every frequency / `factor`;
      - ``ntk`` (static NTK-aware): theta -> theta * factor^(dim/(dim-2));
      - ``dynamic`` (dynamic NTK): the same with a factor grown from the current length L,
        ``factor * L / original_max_position - (factor - 1)``, only once L > `original_max_position`;
      - ``yarn``: interpolation by `factor` for pairs that turn fewer than `beta_slow` times in
        `original_max_position` tokens, none above `beta_fast` turns, a ramp between (`truncate`
        rounds its ends to whole pairs); cos/sin times `attention_factor` (default from `factor`,
        `mscale`, `mscale_all_dim` as in HF);
      - ``llama3``: wavelengths above original/low_freq_factor divided by `factor`, below
        original/high_freq_factor kept, smoothed between;
      - ``longrope``: pair i divided by `short_factor[i]` up to `original_max_position` tokens and by
        `long_factor[i]` beyond (one value per rotated pair); cos/sin times `attention_factor`
        (default ``sqrt(1 + ln factor / ln original_max_position)``).
    `factor` is the extension, target over original context length."""

    method: Optional[Literal["linear", "ntk", "dynamic", "yarn", "llama3", "longrope"]] = None
    factor: Optional[float] = None
    original_max_position: Optional[int] = None  # the context the model was trained at
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: Optional[list] = None
    long_factor: Optional[list] = None

    def validate(self, rotary_dims: int, dim: int, theta: float, key: str) -> None:
        """`rotary_dims`: the layer's rotated channels; `dim`: the exponent denominator of the spectrum
        its pairs come from (rotary_dims for `slice`, head_dim for `truncate` and selected pairs)."""
        method = self.method
        if method is None:
            raise ConfigError(f"{key}.method: required; one of {', '.join(SCALING_METHODS)}")
        if rotary_dims == 0:
            raise ConfigError(f"{key}.method={method}: the layer is NoPE (rotary_dims 0), nothing to scale; "
                              "remove the scaling (for a NoPE layer of model.rope_layers set scaling: null)")
        if method != "longrope" and not (self.factor is not None and self.factor > 1 and math.isfinite(self.factor)):
            raise ConfigError(f"{key}.factor={self.factor}: must be a finite number > 1 for {method} "
                              "(the context extension, target / original length)")
        if method == "longrope" and self.factor is not None and not (1 <= self.factor < math.inf):
            raise ConfigError(f"{key}.factor={self.factor}: must be a finite number >= 1 for longrope")
        if method == "longrope" and self.factor is None and self.attention_factor is None:
            raise ConfigError(f"{key}.factor: required for longrope (target / original length, which sets "
                              f"the attention factor) unless {key}.attention_factor is given")
        if method in ("dynamic", "yarn", "llama3", "longrope") and not (
                isinstance(self.original_max_position, int) and self.original_max_position > 0):
            raise ConfigError(f"{key}.original_max_position={self.original_max_position}: must be an integer > 0 "
                              f"for {method} (the context length the model was trained at)")
        check_ints(key, self, ("original_max_position",))
        for name in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
            check_float(f"{key}.{name}", getattr(self, name), "(0, inf)")
        for name in ("mscale", "mscale_all_dim"):
            if getattr(self, name) is not None:
                check_float(f"{key}.{name}", getattr(self, name), "[0, 10]", "keeps yarn's attention factor "
                            "0.1 * mscale * ln(factor) + 1 in [1, 100] for any factor")
        if method in ("ntk", "dynamic", "yarn") and not theta > 1:
            raise ConfigError(f"{key}.method={method}: needs theta > 1 (got {theta}); it works on log(theta)")
        if method in ("ntk", "dynamic") and dim <= 2:
            raise ConfigError(f"{key}.method={method}: needs a spectrum of at least 4 channels (its exponent "
                              f"dim/(dim-2) is infinite at dim {dim}); rotate more channels or use yarn")
        if method == "longrope" and self.attention_factor is None and self.original_max_position < 2:
            raise ConfigError(f"{key}.original_max_position={self.original_max_position}: must be >= 2 for longrope "
                              "without attention_factor (its default divides by ln original_max_position)")
        if self.attention_factor is not None:
            check_float(f"{key}.attention_factor", self.attention_factor, "(0, 100]",
                        "it multiplies cos and sin: the attention logits scale by its square")
        if method == "yarn" and not (0 < self.beta_slow < self.beta_fast < math.inf):
            raise ConfigError(f"{key}.beta_fast={self.beta_fast}: must be > beta_slow={self.beta_slow} > 0 "
                              "(turns in the original context: pairs above beta_fast keep their frequency)")
        if method == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor < math.inf):
            raise ConfigError(f"{key}.high_freq_factor={self.high_freq_factor}: must be > "
                              f"low_freq_factor={self.low_freq_factor} > 0")
        if method == "longrope":
            for name in ("short_factor", "long_factor"):
                values = getattr(self, name)
                if not isinstance(values, list) or not all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf for v in values):
                    raise ConfigError(f"{key}.{name}={values!r}: must be a list of numbers > 0, one per rotated pair")
                if len(values) != rotary_dims // 2:
                    raise ConfigError(f"{key}.{name}: {len(values)} values but the layer rotates {rotary_dims // 2} "
                                      f"pairs (rotary_dims/2 = {rotary_dims}/2); give one per rotated pair")


# RopeConfig fields of a selected-pair plan
PLAN_KEYS = ("keep_pairs", "select", "pairs")


@dataclass
class RopeConfig:
    """How one attention layer rotates its queries and keys.

    `fraction` (0 = NoPE, 1 = full) or an explicit even `rotary_dims` says how
    many leading channels of each head rotate:
    ``rotary_dims = 2 * floor(fraction * head_dim / 2)``, at least 2 for any
    fraction > 0. `rotary_dims`, when given, wins over `fraction`.

    `style` says which frequencies the rotated channels get:
      - ``slice`` (GPT-NeoX, the partial-RoPE seed): ``theta^(-2i/rotary_dims)``,
        the full spectrum squeezed into the rotated channels;
      - ``truncate`` (HF ``proportional`` rope, p-RoPE): ``theta^(-2i/head_dim)``
        for i < rotary_dims/2, the highest frequencies of the full-head spectrum.
    `layout` says which channels form a pair: ``half`` (rotate_half, NeoX/Llama:
    channel i pairs with i + rotary_dims/2) or ``interleaved`` (GPT-J/RoFormer:
    2i pairs with 2i+1).
    `cache`: ``table`` keeps fp32 cos/sin for positions 0..max seen; ``none``
    computes them from the positions on every call.
    `angles`: the precision in which position x frequency is formed: ``float64`` (exact far
    beyond 2^24 positions) or ``float32`` (as HF transformers and most inference engines form
    it: their logits to the last bit, at ~1e-4 rad of angle error by position 1,000).

    A selected-pair plan (MHA2MLA's partial RoPE, `ropelab.rope_pairs`) keeps some of the
    head_dim/2 pairs of the full-head spectrum ``theta^(-2i/head_dim)``, each at its own
    frequency, and passes the rest through. The kept pairs occupy the first
    ``2 * len(pairs)`` channels of each head (``ropelab convert`` permutes a source model's
    W_q/W_k rows so), so `fraction`, `rotary_dims` and `style` do not apply:
      - `pairs`: the kept pair indices, one list for every KV head or one list per KV head
        (the query heads of a group use their group's);
      - or `keep_pairs` (r) and `select`: ``high`` (pairs 0..r-1, the fastest), ``low`` (the
        slowest r), ``uniform`` (every (head_dim/2)/r-th pair from 0) or ``2-norm`` (scored on
        calibration data: made into `pairs` by ``ropelab convert`` or `train.init_from`).
    """

    fraction: float = 1.0
    rotary_dims: Optional[int] = None
    theta: float = 10_000.0
    style: Literal["slice", "truncate"] = "slice"
    layout: Literal["half", "interleaved"] = "half"
    cache: Literal["table", "none"] = "table"
    angles: Literal["float64", "float32"] = "float64"
    keep_pairs: Optional[int] = None
    select: Optional[Literal["high", "low", "uniform", "2-norm"]] = None
    pairs: Optional[list] = None
    scaling: Optional[RopeScalingConfig] = None  # context extension (linear, ntk, dynamic, yarn, llama3, longrope)

    @property
    def has_plan(self) -> bool:
        return any(getattr(self, key) is not None for key in PLAN_KEYS)

    def resolve_dims(self, head_dim: int) -> int:
        if self.pairs is not None:
            first = self.pairs[0] if self.pairs and isinstance(self.pairs[0], list) else self.pairs
            return 2 * len(first)
        if self.keep_pairs is not None:
            return 2 * int(self.keep_pairs)
        return resolve_rotary_dims(head_dim, self.fraction, self.rotary_dims)

    def validate(self, head_dim: int, key: str = "model.rope") -> None:
        if not (0.0 <= self.fraction <= 1.0):
            raise ConfigError(f"{key}.fraction={self.fraction}: must be in [0, 1] (0 = NoPE, 1 = full RoPE)")
        if self.rotary_dims is not None:
            if self.rotary_dims < 0 or self.rotary_dims % 2:
                raise ConfigError(f"{key}.rotary_dims={self.rotary_dims}: must be an even number >= 0")
            if self.rotary_dims > head_dim:
                raise ConfigError(f"{key}.rotary_dims={self.rotary_dims}: must be <= head_dim ({head_dim})")
        if self.has_plan:
            self.validate_plan(head_dim, key)
        elif self.resolve_dims(head_dim) > head_dim:
            raise ConfigError(f"{key}.fraction={self.fraction}: needs at least 2 channels but head_dim is {head_dim} "
                              "(model.head_dim, or model.d_model / model.n_head)")
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ConfigError(f"{key}.theta={self.theta}: must be a finite number > 0")
        if self.scaling is not None:  # the spectrum's denominator: rotary_dims (slice) or head_dim
            dim = head_dim if self.style == "truncate" or self.has_plan else self.resolve_dims(head_dim)
            self.scaling.validate(self.resolve_dims(head_dim), dim, self.theta, f"{key}.scaling")

    def validate_plan(self, head_dim: int, key: str, kv_heads: Optional[int] = None) -> None:
        """The selected-pair settings; `kv_heads` (when known) checks a per-head `pairs` list's length."""
        n_pairs = head_dim // 2
        if self.keep_pairs is not None:
            if isinstance(self.keep_pairs, bool) or not 0 <= self.keep_pairs <= n_pairs:
                raise ConfigError(f"{key}.keep_pairs={self.keep_pairs}: must be an integer in 0..{n_pairs} "
                                  f"(head_dim {head_dim} has {n_pairs} frequency pairs)")
            if self.pairs is None and self.select is None:
                raise ConfigError(f"{key}.keep_pairs={self.keep_pairs}: also set {key}.select "
                                  f"(high, low, uniform or 2-norm) or give the pairs as {key}.pairs")
        if self.select is not None and self.keep_pairs is None and self.pairs is None:
            raise ConfigError(f"{key}.select={self.select}: also set {key}.keep_pairs (how many pairs to keep)")
        if self.pairs is None:
            return
        per_head = self.pairs and all(isinstance(p, list) for p in self.pairs)
        lists = self.pairs if per_head else [self.pairs]
        for head, kept in enumerate(lists):
            where = f"{key}.pairs[{head}]" if per_head else f"{key}.pairs"
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in kept):
                raise ConfigError(f"{where}: must be a list of pair indices (integers in 0..{n_pairs - 1}) "
                                  "or one such list per KV head")
            if any(not 0 <= i < n_pairs for i in kept) or len(set(kept)) != len(kept):
                raise ConfigError(f"{where}={kept}: pair indices must be distinct integers in 0..{n_pairs - 1}")
            if len(kept) != len(lists[0]):
                raise ConfigError(f"{where}: keeps {len(kept)} pairs but the first head keeps {len(lists[0])}; "
                                  "every KV head keeps the same number")
        if self.keep_pairs is not None and len(lists[0]) != self.keep_pairs:
            raise ConfigError(f"{key}.keep_pairs={self.keep_pairs}: but {key}.pairs keeps {len(lists[0])} per head")
        if per_head and kv_heads is not None and len(lists) != kv_heads:
            raise ConfigError(f"{key}.pairs: {len(lists)} per-head lists but the model has {kv_heads} KV heads "
                              "(give one list per KV head, or one list for all)")


# ---------------------------------------------------------------------------- model


@dataclass
class ModelConfig:
    """Shape and block design of one decoder-only transformer."""

    name: str = "custom"
    vocab_size: Optional[int] = None  # None: follow the tokenizer (padded to a multiple of 64)
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    n_kv_head: Optional[int] = None  # None: same as n_head (no GQA)
    head_dim: Optional[int] = None  # None: d_model // n_head
    d_ff: int = 704
    block: Literal["sequential", "parallel"] = "sequential"
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    attn_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 131_072
    init_std: float = 0.02
    rope: RopeConfig = field(default_factory=RopeConfig)
    # Per-layer exceptions: {layer_index: {rope keys}}; e.g. {3: {fraction: 0}} for a NoPE layer.
    rope_layers: dict = field(default_factory=dict)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_head

    def rope_for_layer(self, layer: int) -> RopeConfig:
        override = self.rope_layers.get(layer) or self.rope_layers.get(str(layer))
        if not override:
            return self.rope
        base = dataclasses.asdict(self.rope)
        # A layer that sets its own channel count or plan drops the run's plan (e.g. {fraction: 0} is NoPE).
        if set(override) & {"fraction", "rotary_dims", *PLAN_KEYS}:
            base.update(dict.fromkeys(PLAN_KEYS))
        merged = base | dict(override)
        return from_dict(RopeConfig, merged, f"model.rope_layers.{layer}")

    def validate(self) -> None:
        check_ints("model", self, ("n_layer", "d_model", "n_head", "n_kv_head", "head_dim", "d_ff", "max_seq_len",
                                   "vocab_size"))
        if self.head_dim is None and self.d_model % self.n_head:
            raise ConfigError(
                f"model.n_head={self.n_head}: must divide model.d_model={self.d_model} (or set model.head_dim)"
            )
        if self.n_head % self.kv_heads:
            raise ConfigError(f"model.n_kv_head={self.n_kv_head}: must divide model.n_head={self.n_head}")
        check_float("model.norm_eps", self.norm_eps, f"[{FLOAT32_TINY!r}, inf)", "smaller rounds to 0 in float32")
        check_float("model.init_std", self.init_std, "(0, 1]")
        for layer in self.rope_layers:
            if not (0 <= int(layer) < self.n_layer):
                raise ConfigError(f"model.rope_layers.{layer}: layer index must be in [0, {self.n_layer})")
        overridden = {int(layer) for layer, override in self.rope_layers.items() if override}
        layers = set(overridden)
        plain = next((i for i in range(self.n_layer) if i not in overridden), None)
        if plain is not None:  # the layers without an override share model.rope: one stands for all
            layers.add(plain)
        for layer in sorted(layers):
            key = "model.rope" if layer not in overridden else f"model.rope_layers.{layer}"
            rope = self.rope_for_layer(layer)
            rope.validate(self.head_size, key)
            if rope.has_plan:
                rope.validate_plan(self.head_size, key, self.kv_heads)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "ModelConfig":
        if name not in MODEL_PRESETS:
            raise ConfigError(f"preset={name!r}: unknown; choose one of {', '.join(MODEL_PRESETS)}")
        cfg = copy.deepcopy(MODEL_PRESETS[name])
        return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _llama(name, n_layer, d_model, n_head, n_kv_head, d_ff, vocab, tie, theta, **kw) -> ModelConfig:
    return ModelConfig(
        name=name, vocab_size=vocab, n_layer=n_layer, d_model=d_model, n_head=n_head, n_kv_head=n_kv_head,
        d_ff=d_ff, tie_embeddings=tie, rope=RopeConfig(fraction=1.0, theta=theta), **kw,
    )


# Published shapes: Llama-3.2-1B and Llama-3.1-8B (Meta's config.json), Pythia-1B (EleutherAI's
# config.json). `pythia-1b-released` is the partial-RoPE seed's released GPT-NeoX config for its
# "Pythia-1B" runs: sequential blocks, RMSNorm, SwiGLU, no biases, 8 heads of 256, untied.
MODEL_PRESETS: dict[str, ModelConfig] = {
    # CPU-sized: head_dim 64 like Llama-3.2-1B, so the seed's fractions map to 0/2/6/16/32/48/64 dims.
    "tiny-llama": _llama("tiny-llama", 4, 128, 2, 1, 384, None, True, 10_000.0, max_seq_len=8192),
    "tiny-pythia": ModelConfig(
        name="tiny-pythia", n_layer=4, d_model=256, n_head=4, d_ff=1024, block="parallel", norm="layernorm",
        mlp="gelu", attn_bias=True, mlp_bias=True, max_seq_len=8192, rope=RopeConfig(fraction=0.25),
    ),
    "llama-3.2-1b": _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128_256, True, 500_000.0),
    "llama-3.1-8b": _llama("llama-3.1-8b", 32, 4096, 32, 8, 14_336, 128_256, False, 500_000.0),
    "llama-8b-36l": _llama("llama-8b-36l", 36, 4096, 32, 8, 14_336, 128_256, False, 500_000.0),
    "pythia-1b": ModelConfig(
        name="pythia-1b", vocab_size=50_304, n_layer=16, d_model=2048, n_head=8, d_ff=8192, block="parallel",
        norm="layernorm", mlp="gelu", attn_bias=True, mlp_bias=True, max_seq_len=2048,
        rope=RopeConfig(fraction=0.25),
    ),
    "pythia-1b-released": ModelConfig(
        name="pythia-1b-released", vocab_size=50_304, n_layer=16, d_model=2048, n_head=8, d_ff=8192,
        max_seq_len=8192, rope=RopeConfig(fraction=0.25),
    ),
    # The distillation seed's student, MobileLLM-Pro 1B as publicly summarised: 30 layers, d_model
    # 1280, 20 query / 4 KV heads of 64, Llama-4 vocabulary (202,048), tied. d_ff 6144 is our
    # assumption: with it the model has the reported ~1.08B parameters.
    "mobilellm-pro-1b": _llama("mobilellm-pro-1b", 30, 1280, 20, 4, 6144, 202_048, True, 10_000.0, max_seq_len=131_072),
}


# ----------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """Where tokens come from and how they are packed into windows.

    `corpus`: ``stdlib`` or ``stdlib-prose`` (the built-in corpora: standard-library source, or its
    docstrings and comments; tokenized on first use) or a folder written by ``ropelab data prepare``
    (its own validation split; `val_percent` applies to the built-in corpora only).
    `pack`: ``cross`` cuts the token stream every `seq_len` tokens, documents running across
    window edges; ``whole`` keeps documents whole, padding the rest of a window (no loss on
    padding) and cutting documents longer than `seq_len` into pieces.
    `mask_boundary_labels`: no loss on a document's last token, whose target is the next
    document's first. `positions`: ``running`` over the window, or ``restart`` at each document.
    `max_doc_len`: cut documents into pieces of at most this many tokens, each treated as a document
    (short documents from any corpus; see `ropelab.data.loader`).
    `verify` (prepared folders): ``once`` hashes the shards on first use on this machine,
    ``always`` at every start, ``sizes`` only checks file sizes.
    """

    corpus: str = "stdlib"  # "stdlib", "stdlib-prose", or a prepared shard folder
    tokenizer: str = "bytes"  # "bytes", "bpe:<vocab>", or an HF tokenizer name / path
    seq_len: int = 256
    positions: Literal["running", "restart"] = "running"  # restart: position ids reset at each document
    val_percent: float = 2.0  # share of stdlib files held out for validation (stable hash of the path)
    pack: Literal["cross", "whole"] = "cross"
    mask_boundary_labels: bool = False
    verify: Literal["once", "always", "sizes"] = "once"
    max_doc_len: Optional[int] = None

    def validate(self) -> None:
        check_ints("data", self, ("seq_len", "max_doc_len"))
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
    factor) and model.max_seq_len. Weights and optimizer state carry over."""

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
            allowed = name in self.MODEL_KEYS or name.startswith("model.rope.scaling.")
            if name in self.FIXED_KEYS or (name.startswith("model.") and not allowed):
                raise ConfigError(
                    f"{key}.overrides.{name}: fixed for the whole run; a phase may change data.*, attention.*, "
                    f"train.* (optimiser and schedule) and {', '.join(self.MODEL_KEYS)} (and its sub-keys)"
                )


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


# ------------------------------------------------------------------ dict <-> dataclass


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r}: must be one of {', '.join(repr(a) for a in args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return from_dict(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r}: must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "4e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: must be a number")
        return finite_number(value, key)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: must be a string")
        return value
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: must be a mapping")
        return value
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r}: must be a list")
        if args:
            return [_coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
        return value
    return value


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(f"{dotted}: unknown key; allowed: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.rope.fraction=0.25"`` -> ``("model.rope.fraction", 0.25)`` (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. model.rope.fraction=0.25")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict; ``name[i]`` addresses item i of a list (e.g.
    ``train.phases[1].overrides.model.rope.theta``, with the rest taken as one dotted key)."""
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        match = re.fullmatch(r"(\w+)\[(\d+)\]", part)
        if match:
            items = node.get(match.group(1))
            index = int(match.group(2))
            if not isinstance(items, list) or index >= len(items) or not isinstance(items[index], dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: no such list item, cannot set {key}")
            node = items[index]
            if parts[i + 1] == "overrides":  # phase overrides hold dotted keys as they are
                node.setdefault("overrides", {})[".".join(parts[i + 2 :])] = value
                return
            continue
        child = node.get(part)
        if not isinstance(child, dict):
            if part in node and child is not None:
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: is not a section, cannot set {key}")
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config keys")
    return data


def build_run_config(
    base: dict | None = None, preset: str | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Merge defaults < model preset < YAML dict < dotted overrides, then validate."""
    tree = copy.deepcopy(base) if base else {}
    preset = preset or tree.pop("preset", None)
    for text in overrides:
        key, value = parse_override(text)
        if key == "preset":
            preset = value
            continue
        set_dotted(tree, key, value)
    model_tree = tree.pop("model", {}) or {}
    if not isinstance(model_tree, dict):
        raise ConfigError("model: expected a mapping of model keys")
    model_preset = model_tree.pop("preset", None) or preset or "tiny-llama"
    model_dict = dataclasses.asdict(ModelConfig.from_name(model_preset))
    for key, value in model_tree.items():
        if key == "rope" and isinstance(value, dict):
            model_dict["rope"] = model_dict["rope"] | value
        else:
            model_dict[key] = value
    tree["model"] = model_dict
    return from_dict(RunConfig, tree).validate()
