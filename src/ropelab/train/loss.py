"""Chunked distillation loss: forward KL from a teacher's logits, mixed with cross-entropy.

For each kept token (label != -100), with temperature T, student logits s and teacher logits t:

    kd   = T^2 * KL(p || q),  p = softmax(t / T),  q = softmax(s / T)   (forward KL, Hinton et al. 2015)
    ce   = -log softmax(s)[label]
    loss = alpha * kd + (1 - alpha) * ce + z_loss * logsumexp(s)^2

each averaged over the kept tokens of the batch (all three are 0 when no token is kept). alpha = 1
is pure KD, the "Short Data, Long Context" seed's setup; the T^2 factor keeps the gradient's scale
independent of T.

Sparse teacher targets (`top_k` = k). The teacher keeps its k most likely ids S; everything else
becomes one "rest" bucket, so both sides are distributions over k + 1 outcomes:

    p_rest = 1 - sum_{i in S} p_i,   q_rest = 1 - sum_{i in S} q_i
    KL_k   = sum_{i in S} p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)

Merging outcomes never increases a KL divergence, so 0 <= KL_k <= KL, with equality at k = V
(p_rest = 0). The student's probabilities come from its full softmax, so mass it puts outside S is
penalised through q_rest rather than ignored. q_rest is summed over the ids outside S (a logsumexp
of the student's log-probabilities), not taken as 1 - sum q_i, which cancels to 0 in fp32 as soon as
S holds nearly all of the student's mass.

Memory. Logits never exist for the whole window: tokens are processed `chunk_tokens` at a time,
the student's logits from its hidden states and head, the teacher's from its own hidden states and
head (`TeacherHidden`) or from stored top-k log-probabilities (`TeacherTopK`). The gradients with
respect to the student's hidden states and head are computed in closed form (see `_chunk`) and
accumulated chunk by chunk during the forward pass (`_ChunkedLoss`, the approach of fused linear
cross-entropy kernels), so backward holds no chunk's logits either, and none are recomputed. Peak
memory: about six fp32 (chunk_tokens x V) tensors with a teacher, one without (cross-entropy alone
works on the logits in place, `_ce_chunk`), plus one gradient of the student's head. The logits of
consecutive chunks share one buffer of up to GROUP_BYTES (64 MiB: two bf16 chunks of 256 x 49k;
fp32 chunks of that size stay one per group) where their gradients are formed in place, and the
head's gradient is one product over the whole group's tokens instead of one per chunk. Under
autocast the head is cast to its dtype once per call (autocast itself would cast the head's
transpose again for every chunk).

Vocabulary. The teacher's logits cover the ids of the tokenizer both models share; student columns
beyond them (embedding rows padded to a multiple of 64) get zero teacher probability: they stay in
the student's softmax, so KD pushes them down, and are never matched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import has_torch_function

from ropelab.layer_kernels import add_widened_loop
from ropelab.precision import autocast_dtype
from ropelab.train.cross_entropy_kernel import ce_chunk


class KDLoss(NamedTuple):
    loss: torch.Tensor  # the training objective (differentiable)
    kd: torch.Tensor  # mean T^2-scaled KL over kept tokens (detached; 0 without a teacher)
    ce: torch.Tensor  # mean cross-entropy over kept tokens (detached)
    z: torch.Tensor  # mean logsumexp(student logits)^2 over kept tokens (detached)


@dataclass
class TeacherHidden:
    """A teacher's final hidden states and output head: its logits, one chunk of tokens at a time.

    `weight` holds only the rows of real tokens (ids the shared tokenizer defines); padding rows are
    sliced off by whoever builds this (see `ropelab.distill.teacher`)."""

    hidden: torch.Tensor  # (B, T, C_t)
    weight: torch.Tensor  # (V, C_t)
    bias: Optional[torch.Tensor] = None  # (V,)

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits (n, V) of the flattened (B * T) token rows `rows`."""
        return F.linear(self.hidden.flatten(0, 1)[rows], self.weight, self.bias).float()


@dataclass
class TeacherTopK:
    """Stored sparse teacher targets: log-probabilities at `temperature` of the teacher's k most
    likely ids, most likely first (what `teacher_topk` returns and the offline cache holds)."""

    logprobs: torch.Tensor  # (B, T, k)
    ids: torch.Tensor  # (B, T, k)
    temperature: float

    def rows(self, rows: torch.Tensor, k: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
        k = k or self.ids.shape[-1]
        return self.logprobs.flatten(0, 1)[rows, :k].float(), self.ids.flatten(0, 1)[rows, :k].long()


Teacher = Union[TeacherHidden, TeacherTopK]


def teacher_topk(logits: torch.Tensor, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities at `temperature`, ids) of the k most likely ids of each row, most likely first."""
    logits = logits.float()
    values, ids = logits.topk(k, dim=-1)
    return values / temperature - torch.logsumexp(logits / temperature, -1, keepdim=True), ids


@dataclass
class _Spec:
    teacher: Optional[Teacher]
    temperature: float
    alpha: float
    top_k: Optional[int]
    chunk_tokens: int
    z_loss: float

    @property
    def weights(self) -> tuple[float, float, float]:
        """Weights of (KD, CE, logsumexp^2) in the loss."""
        if self.teacher is None:
            return 0.0, 1.0, self.z_loss
        return self.alpha, 1.0 - self.alpha, self.z_loss


def _kl_full(logq: torch.Tensor, zt: torch.Tensor, T: float):
    """KL(p || q) per row with p = softmax(zt / T) over the first V' columns, and p (the gradient's
    target). `logq` (n, V) is the student's log-softmax at T; `zt` is overwritten."""
    logp = zt.div_(T) if T != 1 else zt
    logp = logp.sub_(logp.logsumexp(-1, keepdim=True)).clamp_(min=torch.finfo(logp.dtype).min)  # -inf: p = 0
    p = logp.exp()
    kl = torch.linalg.vecdot(p, logp.sub_(logq[:, : p.shape[1]]))
    return kl, p


def _kl_topk(logq: torch.Tensor, logp: torch.Tensor, ids: torch.Tensor, want_grad: bool):
    """KL over the teacher's top-k ids plus the rest bucket per row (module docstring), and, wanted,
    the gradient's target: p on S, and outside S the rest mass spread like the student's, p_rest q_j / q_rest."""
    logq_k = logq.gather(1, ids)
    p_k = logp.exp()
    kl = torch.linalg.vecdot(p_k, (logp - logq_k).masked_fill_(p_k == 0, 0.0))
    if ids.shape[1] == logq.shape[1]:  # k = V: no rest bucket
        return kl, (ids, p_k, None) if want_grad else None
    p_rest = (1.0 - p_k.sum(-1)).clamp(min=0.0)
    # The student's rest mass from its own log-probabilities: 1 - sum(q_k) cancels catastrophically.
    logq_rest = logq.scatter(1, ids, float("-inf")).logsumexp(-1)
    kl = kl + torch.xlogy(p_rest, p_rest) - p_rest * logq_rest
    spread = torch.exp(logq + (torch.log(p_rest) - logq_rest)[:, None]) if want_grad else None
    return kl, (ids, p_k, spread) if want_grad else None


def _chunk(zs: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, spec: _Spec, grad_scale: Optional[float]):
    """Sums of (KD, CE, logsumexp^2) over one chunk and, given `grad_scale`, the gradient of
    `grad_scale` x their weighted sum with respect to the student's fp32 logits `zs` (n, V), which
    is overwritten. Each full-size step works in place where it can: with a teacher a chunk holds
    about six (n, V) fp32 tensors at its peak, without one a single one (`_ce_chunk`).

    Gradients, per row, with s = softmax(zs), q = softmax(zs / T):
      d CE / d zs = s - onehot(label);   d lse^2 / d zs = 2 lse s;   d kd / d zs = T (q - target),
    target = p for the full vocabulary (0 on student-only columns), and for top-k p on S and
    p_rest q_j / q_rest outside S."""
    w_kd, w_ce, w_z = spec.weights
    if spec.teacher is None:
        return _ce_chunk(zs, labels, w_ce, w_z, grad_scale)
    lse = zs.logsumexp(-1, keepdim=True)
    sums = [zs.new_zeros(()), (lse - zs.gather(1, labels[:, None])).sum(), lse.square().sum()]
    grad = None
    if grad_scale is not None and (w_ce or w_z):
        grad = torch.sub(zs, lse).exp_().mul_((w_ce + 2 * w_z * lse) * grad_scale)
        grad[torch.arange(len(labels), device=zs.device), labels] -= w_ce * grad_scale
    teacher, T = spec.teacher, spec.temperature
    if teacher is None:
        return torch.stack(sums), grad
    if T != 1:
        zs.div_(T)
        lse = zs.logsumexp(-1, keepdim=True)
    logq = zs.sub_(lse)
    want_kd = grad_scale is not None and w_kd > 0
    if isinstance(teacher, TeacherTopK):
        kl, target = _kl_topk(logq, *teacher.rows(rows, spec.top_k), want_kd)
    elif spec.top_k is not None:
        kl, target = _kl_topk(logq, *teacher_topk(teacher.logits(rows), T, spec.top_k), want_kd)
    else:
        kl, target = _kl_full(logq, teacher.logits(rows), T)
    sums[0] = T * T * kl.sum()
    if want_kd:
        g = logq.exp_()  # q
        if isinstance(target, torch.Tensor):
            g[:, : target.shape[1]] -= target
        else:
            ids, p_k, spread = target
            q_k = g.gather(1, ids)
            if spread is not None:
                g -= spread
            g.scatter_(1, ids, q_k - p_k)
        g.mul_(w_kd * T * grad_scale)
        grad = g if grad is None else grad.add_(g)
    return torch.stack(sums), grad


def _ce_chunk(zs: torch.Tensor, labels: torch.Tensor, w_ce: float, w_z: float, grad_scale: Optional[float]):
    """`_chunk` without a teacher: every full-size step in place on `zs`, so the chunk holds one (n, V)
    tensor. `logsumexp` and an out-of-place `zs - lse` would each allocate (and page in) another:
    on a 49k vocabulary that was most of the loss's time."""
    picked = zs.gather(1, labels[:, None])  # the labels' logits, before zs is overwritten
    peak = zs.amax(-1, keepdim=True)
    e = zs.sub_(peak).exp_()  # exp(zs - max)
    total = e.sum(-1, keepdim=True)
    lse = total.log().add_(peak)
    sums = torch.stack([zs.new_zeros(()), (lse - picked).sum(), lse.square().sum()])
    if grad_scale is None or not (w_ce or w_z):
        return sums, None
    grad = e.mul_(((w_ce + 2 * w_z * lse) * grad_scale).div_(total))  # softmax, scaled
    grad[torch.arange(len(labels), device=zs.device), labels] -= w_ce * grad_scale
    return sums, grad


def _add_in_blocks(total: torch.Tensor, part: torch.Tensor, rows: int = 4096) -> None:
    """total += part for a part of another dtype (a bf16 product into an fp32 gradient): in one pass on CPU
    (`layer_kernels.add_widened_loop`), else a block of rows at a time: add_ converts its whole operand to
    total's dtype first, and a (V, C) conversion is over glibc's mmap threshold, so it would be mapped and
    paged in anew on every call. The same sums either way."""
    if add_widened_loop(total, part, out=total) is not None:
        return
    for start in range(0, total.shape[0], rows):
        total[start:start + rows].add_(part[start:start + rows])


# The head's gradient runs once per group of chunks whose logits fit in this many bytes (module docstring).
# On SmolLM2-135M at 4 x 512 tokens a 64 MiB group added 69 MiB to a bf16 step's peak, 96 MiB 121 MiB,
# and 96 MiB (two fp32 chunks) 115 MiB to an fp32 step's, where 64 MiB adds nothing (BENCHMARKS.md).
GROUP_BYTES = 64 << 20


class _ChunkedLoss(torch.autograd.Function):
    """Loss and its gradients, chunk by chunk, in one forward pass (gradients in closed form, see
    `_chunk`); backward only scales the stored gradients of the hidden states and the head."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, spec: _Spec):
        kept = (labels != -100).nonzero().squeeze(1)
        scale = 1.0 / max(kept.numel(), 1)
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = None  # the first chunk's product, then the others added in place
        grad_scale = scale if need_h or need_w else None
        sums = torch.zeros(3, device=hidden.device)
        # Under autocast (with no torch-function mode taking over its products, as precision.Bf16GemmInFp32
        # does) the head and the hidden states are cast once, and each chunk's gradient once for both of its
        # products, which then run with autocast off: autocast would cast the head again for every product
        # of every chunk (a view of it is never cached) and the gradient once per product. The same casts,
        # so the same values; the teacher's logits stay autocast's.
        cast = autocast_dtype(hidden.device.type)
        plain = not has_torch_function((hidden, weight))  # no mode or tensor subclass routes the products
        own_casts = cast is not None and plain and torch.float64 not in (hidden.dtype, weight.dtype)  # as autocast
        head = weight.to(cast) if own_casts else weight
        states = hidden.to(cast) if own_casts else hidden

        def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # F.linear, not @: autocast and `ropelab.precision`'s GEMM policy route linear layers only
            if not own_casts:
                return F.linear(x, w)
            with torch.autocast(x.device.type, enabled=False):
                return F.linear(x, w)

        # The products go into one buffer of `group` chunks (GROUP_BYTES at most), in the product's dtype
        # (fp32, or autocast's with the casts above), where the loss forms each chunk's gradient in place
        # (the CPU loop of `cross_entropy_kernel` without a teacher, `_chunk` on fp32 logits). The head's
        # gradient then runs once per group, over all its chunks' tokens: that product's inner dimension
        # is the tokens: over 2,048 tokens of SmolLM2's head, eight bf16 GEMMs of 256 took 0.45 s, four of
        # 512 0.35 s, two of 1,024 0.32 s (AMD EPYC Zen 4, 2 threads).
        # Logits that must be copied to fp32 go into one reused chunk buffer: a fresh (chunk, V) tensor
        # would be paged in anew. A chunk's gradient is used before later logits overwrite its rows.
        direct = cast is None and plain and hidden.dtype == head.dtype == torch.float32
        written = direct or own_casts
        group = max(1, GROUP_BYTES // (spec.chunk_tokens * head.shape[0] * head.element_size())) if written else 1
        buffers: dict[str, torch.Tensor] = {}

        def rows_of(name: str, dtype: torch.dtype, rows: int, start: int, n: int) -> torch.Tensor:
            if name not in buffers:
                buffers[name] = hidden.new_empty(min(rows, kept.numel()), head.shape[0], dtype=dtype)
            return buffers[name][start:start + n]

        pending: list[tuple[int, torch.Tensor]] = []  # (first buffer row, token rows) of the chunks waiting

        def head_gradient(grad: torch.Tensor, h: torch.Tensor) -> None:  # h: the hidden states of grad's rows
            nonlocal grad_w
            h = h.to(head.dtype)
            if grad_w is None:
                grad_w = linear(grad.t(), h.t()).to(weight.dtype)
            elif cast is None:
                grad_w.addmm_(grad.t(), h)  # in place: no (V, C) temporary
            else:
                _add_in_blocks(grad_w, linear(grad.t(), h.t()))

        def flush() -> None:  # the waiting chunks, consecutive in the buffer
            if pending:
                rows = torch.cat([r for _, r in pending])
                head_gradient(buffers["products"][pending[0][0]:pending[0][0] + len(rows)], states[rows])
                pending.clear()

        for index, rows in enumerate(kept.split(spec.chunk_tokens)):
            h = states[rows]
            slot = index % group
            if written:
                zs = torch.mm(h, head.t(), out=rows_of("products", head.dtype, group * spec.chunk_tokens,
                                                       slot * spec.chunk_tokens, len(rows)))
            else:
                zs = linear(h, head)
            fast = None
            if spec.teacher is None and zs.dtype == head.dtype:
                fast = ce_chunk(zs, labels[rows], *spec.weights[1:], grad_scale)
            if fast is None:
                if zs.dtype != torch.float32:
                    zs = rows_of("fp32", torch.float32, spec.chunk_tokens, 0, len(rows)).copy_(zs)
                fast = _chunk(zs, labels[rows], rows, spec, grad_scale)
            chunk, grad = fast
            sums += chunk
            if grad is None:
                continue
            grad = grad.to(head.dtype)
            if need_h:
                grad_h[rows] = linear(grad, head.t()).to(grad_h.dtype)
            if not need_w:
                continue
            if written and grad.data_ptr() == zs.data_ptr() and zs.dtype == head.dtype:  # in its group's rows
                pending.append((slot * spec.chunk_tokens, rows))
                if slot == group - 1:
                    flush()
            else:
                flush()
                head_gradient(grad, h)
        flush()
        if need_w and grad_w is None:  # no labelled token
            grad_w = torch.zeros_like(weight)
        # kept as attributes, not saved tensors, so that backward can hand them on without a copy
        ctx.grads = (grad_h, grad_w)
        means = sums * scale
        loss = sum(w * m for w, m in zip(spec.weights, means))
        kd, ce, z = means[0], means[1], means[2]
        ctx.mark_non_differentiable(kd, ce, z)
        return loss, kd, ce, z

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.grads is None:
            raise RuntimeError("kd_loss: backward ran twice through one loss (retain_graph is not supported)")
        grads, ctx.grads = ctx.grads, None
        # scaled in place and handed on: autograd takes the head's gradient as the weight's .grad
        # instead of copying it, which spares a (V, C) tensor for the whole backward pass. A CPU loss's
        # usual gradient of 1 skips the pass over (V, C) (4 ms on SmolLM2); on a GPU, reading it would wait.
        if grad_loss.device.type == "cpu" and grad_loss.item() == 1.0:
            return *grads, None, None
        return *(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads), None, None


def kd_loss(
    student_hidden: torch.Tensor,
    student_head: Union[nn.Linear, torch.Tensor],
    labels: torch.Tensor,
    teacher: Optional[Teacher] = None,
    temperature: float = 1.0,
    alpha: float = 1.0,
    top_k: Optional[int] = None,
    chunk_tokens: int = 4096,
    z_loss: float = 0.0,
) -> KDLoss:
    """Chunked KD + CE loss of a student whose logits are ``student_hidden @ head.T``.

    student_hidden (B, T, C); student_head an `nn.Linear` without bias or its weight (V, C); labels
    (B, T), -100 = ignored; teacher a `TeacherHidden`, a `TeacherTopK`, or None for cross-entropy
    only (alpha is then ignored). Returns `KDLoss`; every figure is a mean over the kept tokens.
    """
    weight = student_head.weight if isinstance(student_head, nn.Module) else student_head
    if isinstance(student_head, nn.Linear) and student_head.bias is not None:
        raise ValueError("kd_loss: the student head must have no bias")
    if not temperature > 0:
        raise ValueError(f"kd_loss: temperature={temperature} must be > 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"kd_loss: alpha={alpha} must be in [0, 1]")
    if teacher is not None:
        vocab = teacher.vocab if isinstance(teacher, TeacherHidden) else teacher.ids.shape[-1]
        if top_k is not None and not 1 <= top_k <= vocab:
            raise ValueError(f"kd_loss: top_k={top_k} must be in [1, {vocab}]")
        if isinstance(teacher, TeacherHidden) and vocab > weight.shape[0]:
            raise ValueError(f"kd_loss: the teacher has {vocab} tokens, the student only {weight.shape[0]}")
        if isinstance(teacher, TeacherTopK) and not math.isclose(teacher.temperature, temperature):
            raise ValueError(f"kd_loss: targets stored at temperature {teacher.temperature}, asked for {temperature}")
    spec = _Spec(teacher, float(temperature), float(alpha), top_k, int(chunk_tokens), float(z_loss))
    return KDLoss(*_ChunkedLoss.apply(student_hidden.flatten(0, 1), weight, labels.flatten(), spec))


__all__ = ["KDLoss", "TeacherHidden", "TeacherTopK", "kd_loss", "teacher_topk"]
