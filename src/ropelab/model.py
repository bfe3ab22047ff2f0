"""The ropelab transformer: one decoder-only model, sequential (Llama) or parallel (GPT-NeoX) blocks.

Shapes: B batch, T tokens, C d_model, H query heads, K key/value heads, D head_dim, V vocab;
S tokens seen by a key/value cache (generation) before this forward's T, of which it holds the last L.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ropelab.attention import Documents, attend
from ropelab.config.layout import QueryTemperature
from ropelab.config.model import ModelConfig
from ropelab.kv_cache import KVCache
from ropelab.layers import fusable, residual_add, rms_norm, rms_norm_linear, swiglu_, swiglu_linear
from ropelab.mla.attention import LatentAttention
from ropelab.position.registry import ATTENTIONS, SCORE_BIASES, build_rotation, rebuild_after_meta, rotation_setting
from ropelab.rope.embedding import RotaryEmbedding

CHECKPOINTING = ("none", "mlp", "full")  # activation checkpointing modes (Transformer.set_activation_checkpointing)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight * (x * rsqrt(mean(x^2) + eps)) in fp32, rounded to x's dtype before the weight;
        # autograd keeps only x and rstd (ropelab.layers)
        return rms_norm(x, self.weight, self.eps)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps)


def project(norm: Optional[nn.Module], x: torch.Tensor, *linears: nn.Linear) -> tuple[torch.Tensor, ...]:
    """Each linear layer of norm(x) (of x itself without a norm). While training, an RMSNorm runs
    together with them, so that backward keeps x and its rstd instead of the normalised x
    (ropelab.layers.rms_norm_linear), in fp32 and under autocast alike; the norm module's own forward,
    and so its hooks, run only where the fused layers do not (ropelab.layers.fusable)."""
    if isinstance(norm, RMSNorm) and fusable(x):
        return rms_norm_linear(x, norm.weight, norm.eps, [(linear.weight, linear.bias) for linear in linears])
    x = x if norm is None else norm(x)
    return tuple(linear(x) for linear in linears)


def hooked(*modules: nn.Module) -> bool:
    """Whether any of `modules` has a forward hook, which may keep its output: then the output is not
    changed in place (an inference forward otherwise rotates q and k, and forms silu(gate) * up, in place)."""
    return any(module._forward_hooks for module in modules)


def query_temperature(q: torch.Tensor, position_ids: torch.Tensor, temperature: QueryTemperature) -> torch.Tensor:
    """q (B, H, T, D) times Llama 4's NoPE temperature at each token's position (B, T): computed in fp32
    and rounded back to q's dtype, as HF's `Llama4TextAttention` does (it counts positions from the
    cache length; these are the model's position ids, equal to those unless positions restart)."""
    positions = position_ids.float()
    scale = torch.log1p(torch.floor((positions + 1.0) / temperature.floor_scale)) * temperature.attn_scale + 1.0
    return (q * scale[:, None, :, None]).to(q.dtype)  # (B, 1, T, 1) over heads and channels


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__()
        self.layer = layer  # where its keys and values go in a KVCache
        C, H, K, D = config.d_model, config.n_head, config.kv_heads, config.head_size
        self.n_head, self.n_kv_head, self.head_dim = H, K, D
        self.q_proj = nn.Linear(C, H * D, bias=config.attn_bias)
        self.k_proj = nn.Linear(C, K * D, bias=config.attn_bias)
        self.v_proj = nn.Linear(C, K * D, bias=config.attn_bias)
        self.o_proj = nn.Linear(H * D, C, bias=config.attn_bias)
        # QK-Norm over each head's own channels (Henry et al. 2020; Qwen3), before RoPE.
        self.q_norm = RMSNorm(D, config.norm_eps) if config.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(D, config.norm_eps) if config.qk_norm else nn.Identity()
        self.rope = rope
        kind = config.layer_kind(layer)
        self.window = None if kind.attention == "full" else (kind.attention, kind.window)
        self.temperature = kind.temperature  # only on NoPE layers (`ModelConfig.validate`)
        self.backend = "auto"
        # the score-bias and attention channels of `ropelab.config.position` (ALiBi; a method's own attention,
        # called instead of `attend`); None: none
        positions = config.positions_for_layer(layer)
        self.score_bias = next((SCORE_BIASES[p.type.name](p.spec, H) for p in positions
                                if p.type.channel == "score_bias"), None)
        self.attention_override = next((ATTENTIONS[p.type.name](p.spec, H) for p in positions
                                        if p.type.channel == "attention"), None)

    def queries_keys_values(self, x: torch.Tensor, position_ids: torch.Tensor,
                            norm: Optional[nn.Module] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C), normalised here by `norm` if given -> q (B, H, T, D), k and v (B, K, T, D):
        projected, QK-normed, q scaled by the NoPE temperature, q and k rotated."""
        B, T, _ = x.shape
        q, k, v = project(norm, x, self.q_proj, self.k_proj, self.v_proj)  # (B, T, H * D), (B, T, K * D) x 2
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(k.view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)  # (B, K, T, D)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, K, T, D)
        if self.temperature is not None:  # before the (identity) RoPE of a NoPE layer, so RoPE hooks see it
            q = query_temperature(q, position_ids, self.temperature)  # (B, H, T, D)
        # without grad, q and k are ours alone unless a hook kept the projections: rotate them in place
        q, k = self.rope(q, k, position_ids, in_place=not torch.is_grad_enabled() and not hooked(
            self.q_proj, self.k_proj, self.q_norm, self.k_norm))
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: Optional[torch.Tensor],
        kv_cache: Optional[KVCache] = None,
        norm: Optional[nn.Module] = None,
    ) -> torch.Tensor:
        """x (B, T, C), normalised here by `norm` if given -> (B, T, C)."""
        B, T, _ = x.shape
        q, k, v = self.queries_keys_values(x, position_ids, norm)
        key_start = 0  # token index of k's first key
        if kv_cache is not None:  # it holds the last L of the S tokens it has seen (`ropelab.kv_cache`)
            seen = kv_cache.get_seq_length(self.layer)  # S
            k, v = kv_cache.update(k, v, self.layer, {"window": self.window})  # (B, K, L + T, D)
            key_start = seen + T - k.shape[2]
        attention = attend if self.attention_override is None else self.attention_override
        y = attention(q, k, v, doc_ids, self.backend, self.window, key_start, self.score_bias)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.swiglu = config.mlp == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """x (B, T, C), normalised here by `norm` if given -> (B, T, C)."""
        if self.swiglu:  # down(silu(gate) * up), keeping only gate and up for backward (ropelab.layers)
            gate, up = project(norm, x, self.gate_proj, self.up_proj)  # (B, T, F) each
            if not torch.is_grad_enabled() and not hooked(self.gate_proj, self.up_proj):
                return self.down_proj(swiglu_(gate, up))  # ours alone: no new (B, T, F) tensors
            return swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
        (up,) = project(norm, x, self.up_proj)
        return self.down_proj(F.gelu(up))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__()
        self.parallel = config.block == "parallel"
        self.attn_norm = make_norm(config, config.d_model)
        self.attn = Attention(config, rope, layer) if config.mla is None else LatentAttention(config, rope, layer)
        self.mlp_norm = make_norm(config, config.d_model)
        self.mlp = MLP(config)
        # Activation checkpointing: "mlp" keeps only the input of mlp(mlp_norm(x)) for backward and
        # runs it again there; "full" does that with the whole block. Only while gradients are recorded
        # and without a KV cache (recomputing would append to it again).
        self.checkpointing = "none"

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: Optional[torch.Tensor],
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        recompute = self.checkpointing if torch.is_grad_enabled() and kv_cache is None else "none"
        if recompute == "full":
            return checkpoint(self._forward, x, position_ids, doc_ids, None, "none", use_reentrant=False)
        return self._forward(x, position_ids, doc_ids, kv_cache, recompute)

    def _forward(self, x, position_ids, doc_ids, kv_cache, recompute: str) -> torch.Tensor:
        mlp = functools.partial(checkpoint, self._mlp, use_reentrant=False) if recompute == "mlp" else self._mlp
        if self.parallel:  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x))
            return residual_add(residual_add(x, self.attn(x, position_ids, doc_ids, kv_cache, self.attn_norm)), mlp(x))
        x = residual_add(x, self.attn(x, position_ids, doc_ids, kv_cache, self.attn_norm))
        return residual_add(x, mlp(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x, self.mlp_norm)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, init: bool = True):
        """`init=False`: the weights are left unset (uninitialised memory, no random draws) for a caller that
        loads every one of them next; building SmolLM2-135M then takes milliseconds instead of seconds."""
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set before building a model (it follows the tokenizer)")
        config.validate()
        self.config = config
        # One rotation (`ropelab.position.ROTATIONS`, a RotaryEmbedding) per distinct layer setting, shared
        # by the layers that use it; a learned one (FoPE) per layer.
        ropes: dict[str, RotaryEmbedding] = {}
        layer_ropes = []
        for layer in range(config.n_layer):
            key = rotation_setting(config, layer)[0]
            if key not in ropes:
                ropes[key] = build_rotation(config, layer)
            layer_ropes.append(ropes[key])
        self.ropes = list(ropes.values())
        device = torch.get_default_device()
        with contextlib.nullcontext() if init else torch.device("meta"):  # meta: no values, no time
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
            self.blocks = nn.ModuleList(Block(config, rope, layer) for layer, rope in enumerate(layer_ropes))
            self.final_norm = make_norm(config, config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if not init:
            self.to_empty(device=device)  # the rotary embeddings hold no tensors, so only the weights move
            rebuild_after_meta(self)  # buffers that are not weights (ALiBi's slopes) hold garbage until then
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) for every weight matrix and embedding; zero biases; unit norms."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ forward

    def hidden_states(
        self,
        idx: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        doc_ids: Optional[Union[torch.Tensor, Documents]] = None,
        kv_cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """Token ids (B, T) -> final-norm hidden states (B, T, C).

        With `kv_cache` (having seen S earlier tokens, appended to here) the T tokens come after those:
        positions default to S..S+T-1, and `doc_ids` covers all S + T tokens. `doc_ids` may be a
        `Documents` (left-padded rows: chunks from each row's first real token)."""
        B, T = idx.shape
        if position_ids is None:
            start = 0 if kv_cache is None else kv_cache.get_seq_length()
            position_ids = torch.arange(start, start + T, device=idx.device).expand(B, T)
        x = self.embed(idx)  # (B, T, C)
        if doc_ids is not None and not isinstance(doc_ids, Documents):  # boundaries derived once, shared by every layer
            doc_ids = Documents(doc_ids)
        for block in self.blocks:
            x = block(x, position_ids, doc_ids, kv_cache)
        return self.final_norm(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        doc_ids: Optional[Union[torch.Tensor, Documents]] = None,
        return_hidden: bool = False,
        kv_cache: Optional[KVCache] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns logits (B, T, V) and, given targets (B, T; -100 ignored), the mean cross-entropy.

        `return_hidden`: return the final-norm hidden states (B, T, C) instead of logits, for losses
        that apply `lm_head` chunk by chunk; going through `forward` (not `hidden_states`) keeps
        DDP's and FSDP's forward hooks in play. `kv_cache`: see `hidden_states`."""
        hidden = self.hidden_states(idx, position_ids, doc_ids, kv_cache)  # (B, T, C)
        if return_hidden:
            return hidden, None
        logits = self.lm_head(hidden)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss

    # ------------------------------------------------------------------ RoPE controls

    def set_rope_theta(self, theta: float) -> None:
        """One theta for every layer."""
        for rope in self.ropes:
            rope.set_theta(theta)
        self.config.rope.theta = float(theta)

    def set_rope(self, config: ModelConfig) -> None:
        """Each layer's RoPE theta and scaling as `config` (e.g. a phase's) gives them: `model.rope`, then
        its layer kind's and its `model.rope_layers` entry's. NoPE layers have neither."""
        self._set_layer_ropes(config, ("theta", "scaling"))
        self.config.rope.theta = config.rope.theta
        self.config.rope.scaling = config.rope.scaling
        for key in ("layer_kinds", "rope_layers", "position", "position_layers"):  # where a layer's RoPE keys can be set
            setattr(self.config, key, copy.deepcopy(getattr(config, key)))

    def set_rope_scaling(self, config: ModelConfig) -> None:
        """Each layer's RoPE scaling as `config` gives it, as `set_rope` (theta stays)."""
        self._set_layer_ropes(config, ("scaling",))
        self.config.rope.scaling = config.rope.scaling

    def _set_layer_ropes(self, config: ModelConfig, keys: tuple[str, ...]) -> None:
        """Sets `keys` of every rotating layer's RotaryEmbedding to its `config.rope_for_layer` values.
        Layers that shared a module but now differ get one each (e.g. a phase raising one kind's theta)."""
        serving: dict[tuple, RotaryEmbedding] = {}  # (module built with, wanted settings) -> module now
        taken: set[int] = set()  # modules already serving some settings
        for layer, block in enumerate(self.blocks):
            rope = block.attn.rope
            if not rope.rotary_dims:
                continue
            wanted = config.rope_for_layer(layer)
            settings = tuple(repr(getattr(wanted, key)) for key in keys)
            if (id(rope), settings) not in serving:
                module = rope
                if id(rope) in taken:  # a copy keeps the module's type (`ropelab.position`) and its settings
                    module = copy.deepcopy(rope)
                    self.ropes.append(module)
                taken.add(id(rope))
                if "theta" in keys:
                    module.set_theta(wanted.theta)
                module.set_scaling(wanted.scaling)
                serving[id(rope), settings] = module
            block.attn.rope = serving[id(rope), settings]

    def set_attention_backend(self, backend: str) -> None:
        for block in self.blocks:
            block.attn.backend = backend

    def set_activation_checkpointing(self, mode: str) -> None:
        """none, mlp (recompute each block's MLP and its norm in backward) or full (each whole block):
        less memory for activations, for the time of running that part of the forward again."""
        if mode not in CHECKPOINTING:
            raise ValueError(f"activation checkpointing {mode!r}: must be one of {', '.join(CHECKPOINTING)}")
        for block in self.blocks:
            block.checkpointing = mode

    def rope_cache_bytes(self) -> int:
        """Bytes held by every cos/sin cache of the model, exact to the byte."""
        return sum(rope.cache_bytes() for rope in self.ropes)

    # ------------------------------------------------------------------ accounting

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # parameters() counts a tied matrix once
        if non_embedding:
            n -= self.embed.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, PaLM's formula: 6N + 12 * layers * heads * head_dim * seq_len, where
        a layer with a sliding or chunked window counts min(seq_len, window) instead of seq_len.

        N counts the weights used in matrix products: the input embedding is a lookup, so an
        untied embedding matrix is left out."""
        c = self.config
        matmul_params = self.num_params() - (0 if c.tie_embeddings else self.embed.weight.numel())
        attended = sum(seq_len if block.attn.window is None else min(seq_len, block.attn.window[1])
                       for block in self.blocks)
        return 6 * matmul_params + 12 * c.n_head * c.head_size * attended

    def mfu(self, tokens_per_second: float, seq_len: int, peak_flops: float) -> float:
        """Model FLOPs utilisation: achieved training FLOP/s over the device's peak."""
        return self.flops_per_token(seq_len) * tokens_per_second / peak_flops


def build_model(config: ModelConfig, device: str | torch.device = "cpu") -> Transformer:
    return Transformer(config).to(device)


def count_params_meta(config: ModelConfig) -> int:
    """Parameter count without allocating weights (for the 8B presets)."""
    with torch.device("meta"):
        return Transformer(config).num_params()


def model_summary(model: Transformer) -> dict:
    c = model.config
    rope = model.ropes[0]
    return {
        "params": model.num_params(),
        "non_embedding_params": model.num_params(non_embedding=True),
        "rotary_dims": rope.rotary_dims,
        "effective_fraction": round(rope.rotary_dims / c.head_size, 4),
        "head_dim": c.head_size,
    }

