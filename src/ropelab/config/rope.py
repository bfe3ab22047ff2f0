"""How a layer rotates its queries and keys: `RopeConfig`, its context extension `RopeScalingConfig`,
and the count of rotated channels (`resolve_rotary_dims`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from ropelab.config.checks import check_float, check_ints
from ropelab.errors import ConfigError, quoted


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
    compute it, on exactly the layer's rotated pairs (see `ropelab.rope.scaling` for the math):

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
                    raise ConfigError(f"{key}.{name}={quoted(values)}: must be a list of numbers > 0, one per rotated pair")
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

    A selected-pair plan (MHA2MLA's partial RoPE, `ropelab.rope.pairs`) keeps some of the
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
                raise ConfigError(f"{where}={quoted(kept)}: pair indices must be distinct integers in 0..{n_pairs - 1}")
            if len(kept) != len(lists[0]):
                raise ConfigError(f"{where}: keeps {len(kept)} pairs but the first head keeps {len(lists[0])}; "
                                  "every KV head keeps the same number")
        if self.keep_pairs is not None and len(lists[0]) != self.keep_pairs:
            raise ConfigError(f"{key}.keep_pairs={self.keep_pairs}: but {key}.pairs keeps {len(lists[0])} per head")
        if per_head and kv_heads is not None and len(lists) != kv_heads:
            raise ConfigError(f"{key}.pairs: {len(lists)} per-head lists but the model has {kv_heads} KV heads "
                              "(give one list per KV head, or one list for all)")
