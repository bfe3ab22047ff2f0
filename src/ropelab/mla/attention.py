"""Multi-head latent attention (`model.mla`, `ropelab.config.mla`): a layer whose key/value cache holds, per
KV head and token, a latent c of rank d and the 2r rotated key channels, instead of 2 x head_dim values.

Shapes: B batch, T tokens, C d_model, H query heads, K key/value heads, G = H / K query heads per KV head,
D head_dim, R = 2r rotated channels, N = D - R non-rotated channels, d the latent rank; L keys held.

Per KV head g, from x (normalised):
  k_rope = W_kr x                     (R)  rotated by the layer's RoPE: the decoupled positional key
  c      = W_down x                   (d)  the latent, shared by the non-rotated keys and the values
  k_nope = W_uk[g] c (+ b_uk)         (N)  key = [k_rope, k_nope], as the source's kept pairs come first
  v      = W_uv[g] c (+ b_uv)         (D)
Queries and the output projection are the source's. Two ways to attend, the same numbers up to rounding:
  * materialised (training, evaluation without a cache): k and v are formed, then ordinary attention;
  * absorbed (generation, `absorb`): W_uk goes into the query and W_uv into the output projection,
    q_h . k = q_rope . k_rope + (W_uk[g]^T q_nope) . c and o = W_o,h W_uv[g] (attention-weighted c), so
    attention runs over the cached [k_rope, c] with values c and nothing is decompressed. The key bias
    b_uk adds q_nope . b_uk to every score of a query alike, which softmax ignores, so it is left out there.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ropelab.attention import attend
from ropelab.config.model import ModelConfig
from ropelab.kv_cache import KVCache
from ropelab.rope.embedding import RotaryEmbedding


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    """nn.Linear, quiet about having no outputs (a NoPE layer's positional key, a fully rotated head's W_uk)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")
        return nn.Linear(n_in, n_out, bias=bias)


class LatentAttention(nn.Module):
    """`ropelab.model.Attention`'s interface (forward, queries_keys_values, o_proj, window, backend, rope)
    for a layer of `model.mla`."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, layer: int):
        super().__init__()
        self.layer = layer
        C, H, K, D = config.d_model, config.n_head, config.kv_heads, config.head_size
        R, d = rope.rotary_dims, config.mla.rank
        self.n_head, self.n_kv_head, self.head_dim, self.rotary_dims, self.rank = H, K, D, R, d
        bias = config.attn_bias
        self.q_proj = nn.Linear(C, H * D, bias=bias)
        self.kr_proj = _linear(C, K * R, bias)  # the rotated key channels, (K * R, C); none in a NoPE layer
        self.kv_down = nn.Linear(C, K * d, bias=False)  # W_down, (K * d, C)
        self.k_up = _linear(d, K * (D - R), bias)  # W_uk of every KV head stacked, (K * N, d): used per head
        self.v_up = nn.Linear(d, K * D, bias=bias)  # W_uv, (K * D, d): used per head
        self.o_proj = nn.Linear(H * D, C, bias=bias)
        # Identity stand-ins where the probe and the 2-norm calibration hook pre-RoPE queries and keys
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.rope = rope
        kind = config.layer_kind(layer)
        self.window = None if kind.attention == "full" else (kind.attention, kind.window)
        self.backend = "auto"
        self.absorb = True  # with a cache: attend over the latent (False: decompress it, the reference)

    # ------------------------------------------------------------------ pieces

    def _split_heads(self, y: torch.Tensor, heads: int) -> torch.Tensor:
        B, T, _ = y.shape
        return y.view(B, T, heads, -1).transpose(1, 2)  # (B, heads, T, width)

    def _up(self, c: torch.Tensor, up: nn.Linear) -> torch.Tensor:
        """c (B, K, L, d) -> each KV head's up-projection (B, K, L, width)."""
        weight = up.weight.view(self.n_kv_head, -1, self.rank)  # (K, width, d)
        y = torch.einsum("bkld,kwd->bklw", c, weight)
        return y if up.bias is None else y + up.bias.view(self.n_kv_head, 1, -1)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C), normalised -> the unrotated positional key (B, K, T, R) and the latent (B, K, T, d)."""
        return self._split_heads(self.kr_proj(x), self.n_kv_head), self._split_heads(self.kv_down(x), self.n_kv_head)

    def queries_keys_values(self, x: torch.Tensor, position_ids: torch.Tensor,
                            norm: Optional[nn.Module] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`ropelab.model.Attention.queries_keys_values`: q (B, H, T, D), k and v (B, K, T, D) decompressed, rotated."""
        x = x if norm is None else norm(x)
        B, T, _ = x.shape
        # the stand-in norms see (B, T, heads, D), as `Attention`'s QK-Norm does
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)  # (B, H, T, D)
        k_rope, c = self.latent(x)
        k = torch.cat([k_rope, self._up(c, self.k_up)], dim=-1)  # (B, K, T, D)
        k = self.k_norm(k.transpose(1, 2)).transpose(1, 2)
        q, k = self.rope(q, k, position_ids)
        return q, k, self._up(c, self.v_up)

    def key_weight(self) -> torch.Tensor:
        """The key projection the latent stands for, (K * D, C): per KV head its rotated rows, then W_uk W_down."""
        K, D, R, d = self.n_kv_head, self.head_dim, self.rotary_dims, self.rank
        down = self.kv_down.weight.view(K, d, -1)  # (K, d, C)
        nope = torch.einsum("knd,kdc->knc", self.k_up.weight.view(K, D - R, d), down)
        return torch.cat([self.kr_proj.weight.view(K, R, -1), nope], dim=1).reshape(K * D, -1)

    def rope_query(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """W_q's rotated rows of every head, (H * R, C), and their bias."""
        H, D, R = self.n_head, self.head_dim, self.rotary_dims
        weight = self.q_proj.weight.view(H, D, -1)[:, :R].reshape(H * R, self.q_proj.in_features)
        bias = self.q_proj.bias
        return weight, None if bias is None else bias.view(H, D)[:, :R].reshape(-1)

    def absorbed_query(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """W_q's non-rotated rows of each head taken through its group's W_uk: (H * d, C) and bias (H * d)."""
        H, K, D, R = self.n_head, self.n_kv_head, self.head_dim, self.rotary_dims
        w_q = self.q_proj.weight.view(K, H // K, D, -1)[:, :, R:]  # (K, G, N, C)
        w_uk = self.k_up.weight.view(K, D - R, self.rank)  # (K, N, d)
        weight = torch.einsum("kgnc,knd->kgdc", w_q, w_uk).reshape(H * self.rank, -1)
        bias = self.q_proj.bias
        if bias is not None:
            bias = torch.einsum("kgn,knd->kgd", bias.view(K, H // K, D)[:, :, R:], w_uk).reshape(-1)
        return weight, bias

    def absorbed_output(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """W_o taken through each head's group's W_uv: (C, H * d), and its bias with W_o b_uv added."""
        H, K, D = self.n_head, self.n_kv_head, self.head_dim
        w_o = self.o_proj.weight.view(-1, K, H // K, D)  # (C, K, G, D)
        w_uv = self.v_up.weight.view(K, D, self.rank)  # (K, D, d)
        weight = torch.einsum("ckgv,kvd->ckgd", w_o, w_uv).reshape(w_o.shape[0], H * self.rank)
        bias = self.o_proj.bias
        if self.v_up.bias is not None:  # attention weights sum to 1: every head's output carries b_uv once
            carried = torch.einsum("ckgv,kv->c", w_o, self.v_up.bias.view(K, D))
            bias = carried if bias is None else bias + carried
        return weight, bias

    def _rotated_latent(self, x: torch.Tensor, position_ids: torch.Tensor,
                        absorb: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C), normalised -> the rotated queries (B, H, T, R; all D channels unless `absorb`: absorbed,
        only the rotated ones are projected as they are, the rest go through W_uk), the rotated positional
        keys (B, K, T, R) and the latents (B, K, T, d)."""
        k_rope, c = self.latent(x)
        q = self._split_heads(F.linear(x, *self.rope_query()) if absorb else self.q_proj(x), self.n_head)
        q, k_rope = self.rope(q, k_rope, position_ids)
        return q, k_rope, c

    def cache_entries(self, x: torch.Tensor, position_ids: torch.Tensor,
                      norm: Optional[nn.Module] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What a cache holds for these tokens, in its key and value slots: the rotated positional keys
        (B, K, T, R) and the latents (B, K, T, d). For a prompt whose attention ran elsewhere
        (`ropelab.evaluate.longctx_candidates`) and whose decoding goes on from the cache."""
        _, k_rope, c = self._rotated_latent(x if norm is None else norm(x), position_ids, absorb=True)
        return k_rope, c

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, doc_ids, kv_cache: Optional[KVCache] = None,
                norm: Optional[nn.Module] = None) -> torch.Tensor:
        """x (B, T, C), normalised here by `norm` if given -> (B, T, C). A cache (`KVCache` or transformers'
        DynamicCache) holds per layer the rotated positional keys (B, K, L, R) and the latents (B, K, L, d)
        in its key and value slots."""
        B, T, _ = x.shape
        if kv_cache is None:
            q, k, v = self.queries_keys_values(x, position_ids, norm)
            y = attend(q, k, v, doc_ids, self.backend, window=self.window)  # (B, H, T, D)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        x = x if norm is None else norm(x)
        q, k_rope, c = self._rotated_latent(x, position_ids, self.absorb)
        seen = kv_cache.get_seq_length(self.layer)
        k_rope, c = kv_cache.update(k_rope, c, self.layer, {"window": self.window})  # (B, K, L + T, R / d)
        key_start = seen + T - c.shape[2]
        if not self.absorb:
            k = torch.cat([k_rope, self._up(c, self.k_up)], dim=-1)
            y = attend(q, k, self._up(c, self.v_up), doc_ids, self.backend, window=self.window, key_start=key_start)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        q_latent = self._split_heads(F.linear(x, *self.absorbed_query()), self.n_head)  # (B, H, T, d)
        # the scores of [q_rope, q_latent] . [k_rope, c] are q . k: keep softmax's scale at 1 / sqrt(D)
        query = torch.cat([q, q_latent], dim=-1) * math.sqrt((self.rotary_dims + self.rank) / self.head_dim)
        y = attend(query, torch.cat([k_rope, c], dim=-1), c, doc_ids, self.backend, window=self.window,
                   key_start=key_start)  # (B, H, T, d)
        return F.linear(y.transpose(1, 2).reshape(B, T, self.n_head * self.rank), *self.absorbed_output())


def set_absorb(model: nn.Module, absorb: bool) -> None:
    """Every latent layer of `model` attends over the latent (True) or decompresses it (False) with a cache."""
    for module in model.modules():
        if isinstance(module, LatentAttention):
            module.absorb = absorb


def latent_cache_values(model: nn.Module) -> int:
    """Values per token that a cache holds for `model`: per layer, K x (d + 2r) for a latent layer,
    K x 2D otherwise."""
    total = 0
    for block in model.blocks:
        attn = block.attn
        per_head = attn.rank + attn.rotary_dims if isinstance(attn, LatentAttention) else 2 * attn.head_dim
        total += attn.n_kv_head * per_head
    return total


__all__ = ["LatentAttention", "set_absorb", "latent_cache_values"]
