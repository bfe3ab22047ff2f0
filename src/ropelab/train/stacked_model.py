"""Stacked members (HFTA, Wang et al., MLSys 2021): N runs of one model shape trained as one model.

Each weight of the members' `Transformer`s is stacked over a leading member axis N, and the forward runs
every matrix product of the N members as one batched product (`torch.bmm` / `baddbmm`), each member with
its own weights and its own RoPE: the eager trainer's rotation kernel on each member's slice of q and k,
at the member's own rotary channels, theta and layout. The loss runs in chunks of tokens through the
eager trainer's CPU cross-entropy loop.

The members' own parameters become views of the stacked ones: a member `Transformer` always holds its
current weights (validation and checkpoints use it as the eager trainer does), and the
`torch.optim.AdamW` the eager trainer builds over it steps the stacked storage in place
(`ropelab.train.stacked_member`).

Shapes: N members, B batch, T tokens, C d_model, H query heads, K key/value heads, D head_dim, V vocab.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ropelab.attention import attend
from ropelab.config import RunConfig
from ropelab.model import Attention, Transformer
from ropelab.rope.embedding import RotaryEmbedding
from ropelab.rope.kernels import rotate_qk_at_positions_
from ropelab.train.autocast import uses_bf16
from ropelab.train.cross_entropy_kernel import ce_chunk, library as ce_library
from ropelab.train.distributed import resolve_device

# model keys that may differ between members: what a member's init draws and its RoPE
MEMBER_MODEL_KEYS = ("name", "rope", "init_std", "max_seq_len", "position")
# keys outside `model` the members must share: the batch each step forms and how it runs
SHARED_KEYS = (("data", "seq_len"), ("data", "tokenizer"), ("train", "micro_batch"), ("train", "grad_accum"),
               ("train", "precision"), ("train", "device"), ("attention", "backend"))
CHUNK_ROWS = 256  # tokens per chunk of the loss (`StackedCrossEntropy`), as the eager trainer's


def member_refusal(config: RunConfig) -> Optional[str]:
    """Why this one run cannot be a stacked member (what the stacked trainer does not do), or None."""
    tc = config.train
    for key, value in (("train.phases", tc.phases), ("train.init_from", tc.init_from),
                       ("train.branch_from", tc.branch_from), ("distill", config.distill),
                       ("train.z_loss", tc.z_loss), ("attention.doc_mask", config.attention.doc_mask),
                       ("train.compile", tc.compile), ("train.data_parallel", tc.data_parallel),
                       ("model.mla", config.model.mla)):
        if value:
            return f"{key} is set; stacked members train fresh single-phase cross-entropy runs only"
    if uses_bf16(config, resolve_device(tc.device, None)):
        return "train.precision: bf16; stacked members train in fp32 only (set train.precision=fp32)"
    model_config = copy.deepcopy(config.model)
    model_config.vocab_size = model_config.vocab_size or 64  # the shape of the layers is all that is checked
    with torch.device("meta"):
        model = Transformer(model_config, init=False)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        found = next((what for what, present in (
            ("latent attention", type(attn) is not Attention), ("an attention window", attn.window is not None),
            ("a query temperature", attn.temperature is not None), ("a score bias", attn.score_bias is not None),
            ("its own attention", attn.attention_override is not None)) if present), None)
        if found:
            return f"model layer {layer}: {found}; stacked members take plain full causal attention only"
        if type(attn.rope) is not RotaryEmbedding or attn.rope.per_head:
            return (f"model layer {layer}: a position encoding other than plain RoPE or NoPE "
                    "(stacked members rotate only those)")
    return None


def stack_key(config: RunConfig) -> dict:
    """What the members of one stack must share: the model shape without the per-member keys, and `SHARED_KEYS`."""
    model = {k: v for k, v in dataclasses.asdict(config.model).items() if k not in MEMBER_MODEL_KEYS}
    return {"model": model, **{f"{section}.{key}": getattr(getattr(config, section), key) for section, key in SHARED_KEYS}}


def stack_refusal(configs: list[RunConfig]) -> Optional[str]:
    """One line saying why these runs cannot train as one stack, or None when they can."""
    if not configs:
        return "no members to stack"
    for index, config in enumerate(configs):
        reason = member_refusal(config)
        if reason is not None:
            return f"member {index}: {reason}"
    first = stack_key(configs[0])
    for index, config in enumerate(configs[1:], start=1):
        other = stack_key(config)
        for key in first:
            if other[key] != first[key]:
                differing = key if key != "model" else "model." + next(k for k in first["model"]
                                                                      if first["model"][k] != other["model"][k])
                return (f"member {index}: {differing} differs from member 0's; stacked members share shape, batch "
                        "and precision")
    return None


def stack_groups(configs: list[RunConfig], most: Optional[int] = None) -> list[list[int]]:
    """The indices of `configs` in groups that can each train as one stack (equal `stack_key`, no
    `member_refusal`), in order of first appearance, of at most `most` members each; a run that cannot
    be a member is a group of its own (to train eagerly)."""
    groups: dict[str, list[list[int]]] = {}
    alone: list[list[int]] = []
    for index, config in enumerate(configs):
        if member_refusal(config) is not None:
            alone.append([index])
            continue
        runs = groups.setdefault(repr(stack_key(config)), [[]])
        if most is not None and len(runs[-1]) == most:
            runs.append([])
        runs[-1].append(index)
    return sorted([group for runs in groups.values() for group in runs] + alone, key=lambda group: group[0])


# One member's rotation at its batch's positions: (positions (B or 1, T), cos and sin tables (rows, r/2),
# rotary dims r, layout), as `rotate_qk_at_positions_` takes them; None for a member that rotates nothing.
MemberRotation = Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, str]]


def member_rotation(rope: RotaryEmbedding, position_ids: torch.Tensor) -> MemberRotation:
    """`MemberRotation` of one member's rotation module at its position ids (B, T)."""
    if not rope.rotary_dims:
        return None
    cos, sin = rope.cos_sin(torch.arange(int(position_ids.max()) + 1, device=position_ids.device)[None])
    return position_ids, cos[0, 0], sin[0, 0], rope.rotary_dims, rope.layout  # tables (rows, r/2)


class StackedRotation(torch.autograd.Function):
    """Each member's RoPE of its q (N, B, H, T, D) and k (N, B, K, T, D): the eager trainer's kernel
    (`rotate_qk_at_positions_`: the CPU loop, which reads and writes the rotated channels only) on
    each member's slice of a copy; backward rotates the gradients back (the inverse rotation)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, rotations: list[MemberRotation]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.rotations = rotations
        return StackedRotation.rotate(q.clone(), k.clone(), rotations, inverse=False)

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        return *StackedRotation.rotate(grad_q.clone(), grad_k.clone(), ctx.rotations, inverse=True), None

    @staticmethod
    def rotate(q: torch.Tensor, k: torch.Tensor, rotations: list[MemberRotation], inverse: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        for n, rotation in enumerate(rotations):
            if rotation is not None:
                positions, cos_table, sin_table, rotary_dims, layout = rotation
                rotate_qk_at_positions_(q[n], k[n], positions, cos_table, sin_table, rotary_dims, layout, inverse)
        return q, k


class StackedCrossEntropy(torch.autograd.Function):
    """Each member's mean cross-entropy (N,) of its head's logits, every token labelled, in chunks of
    `CHUNK_ROWS` tokens as the eager trainer's loss runs (a chunk's logits stay in cache): each chunk's
    logits, their loss and gradient in one pass of the CPU loop (`cross_entropy_kernel.ce_chunk`), then
    the gradients of the hidden states and the head, all in the forward pass; backward scales them by
    each member's weight in the summed loss."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """hidden (N, M, C), head (N, V, C), labels (N, M) in [0, V) -> (N,)."""
        N, M, _ = hidden.shape
        grad_hidden, grad_head = torch.empty_like(hidden), torch.zeros_like(head)
        logits = hidden.new_empty(min(M, CHUNK_ROWS), head.shape[1])  # one chunk's, reused
        sums = hidden.new_zeros(N)
        for n in range(N):
            for start in range(0, M, CHUNK_ROWS):
                rows = slice(start, min(M, start + CHUNK_ROWS))
                chunk = logits[: rows.stop - rows.start]
                torch.mm(hidden[n, rows], head[n].t(), out=chunk)
                sums[n] += ce_chunk(chunk, labels[n, rows], 1.0, 0.0, 1.0 / M)[0][1]  # gradient now in `chunk`
                torch.mm(chunk, head[n], out=grad_hidden[n, rows])
                grad_head[n].addmm_(chunk.t(), hidden[n, rows])
        ctx.save_for_backward(grad_hidden, grad_head)
        return sums / M

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_hidden, grad_head = ctx.saved_tensors
        scale = grad.view(-1, 1, 1)
        return grad_hidden * scale, grad_head * scale, None


class StackedTransformer(nn.Module):
    """The members' weights stacked over a leading axis N; `forward` gives each member's mean loss.

    Built from members of one shape (`stack_refusal`); afterwards each member's parameters are views
    of the stacked ones, so that the member modules follow every update. Parameter names are the
    members' with "." spelled "__"."""

    def __init__(self, members: list[Transformer]):
        super().__init__()
        self.members = members
        self.config = members[0].config
        self.names = [name for name, _ in members[0].named_parameters()]  # a tied matrix once
        self.last_rotations: Optional[tuple[torch.Tensor, list]] = None  # (position ids, `rotations`' tables)
        member_params = [dict(member.named_parameters()) for member in members]
        for name in self.names:
            stacked = nn.Parameter(torch.stack([params[name].detach() for params in member_params]))
            self.register_parameter(name.replace(".", "__"), stacked)
            for index, params in enumerate(member_params):
                params[name].data = stacked.data[index]

    def weight(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "__"))

    def pass_gradients(self) -> None:
        """Give each member's parameters their slice of the stacked gradients (views: clipping in place
        reaches the stacked ones), and drop the stacked parameters' hold on them."""
        for name in self.names:
            stacked = self.weight(name)
            for index, member in enumerate(self.members):
                member.get_parameter(name).grad = None if stacked.grad is None else stacked.grad[index]
            stacked.grad = None

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x (N, M, in) through every member's linear layer `name` -> (N, M, out)."""
        weight = self.weight(name + ".weight").transpose(1, 2)
        bias_name = name + ".bias"
        if bias_name in self.names:
            return torch.baddbmm(self.weight(bias_name).unsqueeze(1), x, weight)
        return torch.bmm(x, weight)

    def norm(self, x: torch.Tensor, name: str, kind: str) -> torch.Tensor:
        """x (N, ..., C) through every member's norm `name`, an RMSNorm or (`kind` "layernorm") a LayerNorm."""
        weight, eps = self.weight(name + ".weight"), self.config.norm_eps
        shape = (weight.shape[0],) + (1,) * (x.dim() - 2) + (weight.shape[-1],)
        if kind == "layernorm":
            return F.layer_norm(x, x.shape[-1:], eps=eps) * weight.view(shape) + self.weight(name + ".bias").view(shape)
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight.view(shape) * (xf * rstd).to(x.dtype)

    def rotations(self, position_ids: torch.Tensor) -> list[Optional[list[MemberRotation]]]:
        """Per layer: each member's `MemberRotation` at its position ids (N, B, T), or None where no member
        rotates; layers whose members share rotation modules share one list. Kept while the position ids
        stay the same (running positions: every step's)."""
        if self.last_rotations is not None and torch.equal(self.last_rotations[0], position_ids):
            return self.last_rotations[1]
        lists: dict[tuple, Optional[list[MemberRotation]]] = {}
        per_layer = []
        for layer in range(self.config.n_layer):
            ropes = [member.blocks[layer].attn.rope for member in self.members]
            key = tuple(id(rope) for rope in ropes)
            if key not in lists:
                rotations = [member_rotation(rope, ids) for rope, ids in zip(ropes, position_ids)]
                lists[key] = None if all(r is None for r in rotations) else rotations
            per_layer.append(lists[key])
        self.last_rotations = (position_ids.clone(), per_layer)
        return per_layer

    def attention(self, x: torch.Tensor, prefix: str, rotation: Optional[list[MemberRotation]], backend: str
                  ) -> torch.Tensor:
        """Normalised x (N, B, T, C) -> every member's attention output (N, B, T, C)."""
        c = self.config
        N, B, T, C = x.shape
        H, K, D = c.n_head, c.kv_heads, c.head_size
        flat = x.reshape(N, B * T, C)
        q = self.linear(flat, prefix + "q_proj").view(N, B, T, H, D)
        k = self.linear(flat, prefix + "k_proj").view(N, B, T, K, D)
        v = self.linear(flat, prefix + "v_proj").view(N, B, T, K, D)
        if c.qk_norm:
            q, k = self.norm(q, prefix + "q_norm", "rmsnorm"), self.norm(k, prefix + "k_norm", "rmsnorm")
        q, k, v = (t.transpose(2, 3) for t in (q, k, v))  # (N, B, H or K, T, D)
        if rotation is not None:
            q, k = StackedRotation.apply(q, k, rotation)
        y = attend(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), None, backend)  # (N * B, H, T, D)
        y = y.view(N, B, H, T, D).transpose(2, 3).reshape(N, B * T, H * D)
        return self.linear(y, prefix + "o_proj").view(N, B, T, C)

    def mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """Normalised x (N, B, T, C) -> every member's MLP output (N, B, T, C)."""
        flat = x.reshape(x.shape[0], -1, x.shape[-1])
        if self.config.mlp == "swiglu":
            hidden = F.silu(self.linear(flat, prefix + "gate_proj")) * self.linear(flat, prefix + "up_proj")
        else:
            hidden = F.gelu(self.linear(flat, prefix + "up_proj"))
        return self.linear(hidden, prefix + "down_proj").view(x.shape)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, backend: str = "auto"
                ) -> torch.Tensor:
        """Token ids, labels (-100: no loss) and position ids, each (N, B, T) -> each member's mean
        cross-entropy over its labelled tokens (N,)."""
        c = self.config
        N, B, T = idx.shape
        embed = self.weight("embed.weight")  # (N, V, C)
        V = embed.shape[1]
        offsets = torch.arange(N, device=idx.device).view(N, 1, 1) * V
        x = F.embedding(idx + offsets, embed.flatten(0, 1))  # (N, B, T, C)
        for layer, rotation in enumerate(self.rotations(position_ids)):
            prefix = f"blocks.{layer}."
            attn = self.attention(self.norm(x, prefix + "attn_norm", c.norm), prefix + "attn.", rotation, backend)
            if c.block == "parallel":
                x = x + attn + self.mlp(self.norm(x, prefix + "mlp_norm", c.norm), prefix + "mlp.")
            else:
                x = x + attn
                x = x + self.mlp(self.norm(x, prefix + "mlp_norm", c.norm), prefix + "mlp.")
        hidden = self.norm(x, "final_norm", c.norm).reshape(N, B * T, -1)
        head = self.weight("embed.weight" if c.tie_embeddings else "lm_head.weight")  # (N, V, C)
        flat_labels = labels.reshape(N, B * T)
        if hidden.device.type == "cpu" and ce_library() is not None and bool((flat_labels >= 0).all()):
            return StackedCrossEntropy.apply(hidden, head, flat_labels)
        logits = torch.matmul(hidden, head.transpose(1, 2))  # (N, B * T, V)
        token_losses = F.cross_entropy(logits.float().flatten(0, 1), flat_labels.flatten(), ignore_index=-100,
                                       reduction="none").view(N, B * T)
        return token_losses.sum(1) / (flat_labels != -100).sum(1)


__all__ = ["StackedCrossEntropy", "StackedRotation", "StackedTransformer", "member_refusal", "member_rotation",
           "stack_groups", "stack_key", "stack_refusal"]
