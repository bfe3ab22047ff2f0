"""The in-place fast path of RoPE under autograd: `PartialRotary` overwrites only the first ``rotary_dims``
channels of q and k, in one autograd node, and its backward rotates only the same channels of the
incoming gradient back (by -angle), in place. Work scales with the fraction; fraction 0 does nothing.
`rotate_in_place` and `partial_rotary` use it when that is safe (see `inplace_target`) and otherwise
tell the caller to take the reference (`ropelab.rope.reference`).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ropelab.rope.kernels import rotate_qk_

# (q, k, inverse) -> None: rotates the rotary channels of q and k in place (see `rotate_qk_`).
Rotation = Callable[..., None]


def _writable(grad: torch.Tensor, other: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`grad`, or a copy of it where writing into it in place would be wrong: its elements overlap
    (an expanded gradient, e.g. of a sum) or it shares memory with `other`."""
    if torch._debug_has_internal_overlap(grad) != 0 or (other is not None and _shares_memory(grad, other)):
        return grad.clone()
    return grad


def _locate(target: torch.Tensor, geom: Optional[tuple]) -> torch.Tensor:
    """q (or k) inside `target`: target itself, or the view that `geom` describes."""
    return target if geom is None else target.as_strided(geom[0], geom[1], target.storage_offset() + geom[2])


class PartialRotary(torch.autograd.Function):
    """Rotate the first `rotary_dims` channels of q and k in place, as one autograd node.

    `rotation(q, k, inverse=...)` does the rotation (see `Rotation`; it knows the angles, the
    rotated channels and the layout). `q_target`/`k_target` are the tensors overwritten and marked
    dirty; `q_geom`/`k_geom` are None when the target is q (k) itself, or (size, stride, offset)
    locating q (k), a view, inside its contiguous base, the target. Rotating the base (not the
    view) keeps autograd from wrapping the node in CopySlices, which would copy the whole gradient
    in backward.

    backward rotates the first `rotary_dims` channels of the incoming gradients by -angle, in
    place; the other channels are passed on untouched. The gradients are written into, as in
    flash-attn's in-place rotary: a gradient whose elements overlap, or the two gradients sharing
    memory, are copied first, but a gradient tensor that autograd also hands to another branch
    (e.g. the rotated q fed to both `q + x` and attention) would be overwritten for that branch too.
    `Attention` feeds q and k only to attention, whose gradients are fresh tensors."""

    @staticmethod
    def forward(ctx, q_target, k_target, rotation, q_geom, k_geom):
        rotation(_locate(q_target, q_geom), _locate(k_target, k_geom), inverse=False)
        ctx.mark_dirty(q_target, k_target)
        ctx.rotation, ctx.geoms = rotation, (q_geom, k_geom)
        return q_target, k_target

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        grad_q = _writable(grad_q)
        grad_k = _writable(grad_k, grad_q)
        grads = []
        for grad, geom in zip((grad_q, grad_k), ctx.geoms):
            if geom is not None and not grad.is_contiguous():  # the view's geometry assumes the base's strides
                grad = grad.contiguous()
            grads.append(grad)
        ctx.rotation(*(_locate(grad, geom) for grad, geom in zip(grads, ctx.geoms)), inverse=True)
        return grads[0], grads[1], None, None, None


def inplace_target(x: torch.Tensor) -> Optional[tuple[torch.Tensor, Optional[tuple]]]:
    """Where `PartialRotary` may write x's rotation under autograd, or None if it may not.

    (x, None) for a non-leaf tensor that is not a view; (base, geometry) for a plain view of a
    contiguous non-leaf base (e.g. q = proj(x).view(B, T, H, D).transpose(1, 2)). None for a leaf,
    a view of a leaf, or a view autograd forbids writing into (made by a multi-output op such as
    split/unbind/chunk, in no-grad mode, or inside a custom Function)."""
    if not x.requires_grad:
        return None
    base = x._base
    if base is None:
        return (x, None) if x.grad_fn is not None else None
    if base.grad_fn is None or not base.is_contiguous() or base._base is not None:
        return None
    if torch._C._autograd._get_creation_meta(x) != torch._C._autograd.CreationMeta.DEFAULT:
        return None
    return base, (tuple(x.shape), tuple(x.stride()), x.storage_offset() - base.storage_offset())


def _view_like(x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """x's view of its own base, taken of `base` instead: by a view and a permute where x is a permutation
    of a layout that fills its base (as q and k (B, H, T, D) of a (B, T, H * D) projection are), whose
    backward is at most one copy of the gradient; else by replaying x's view ops, which autograd records
    as an as_strided, whose backward fills a zero base and copies the gradient into it."""
    if x.storage_offset() == x._base.storage_offset() and x.numel() == base.numel():
        order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))  # outermost first
        view = base.view([x.shape[d] for d in order]).permute(sorted(range(x.dim()), key=order.__getitem__))
        if view.stride() == x.stride():
            return view
    return x._view_func(base)


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _broadcasts_into(cos: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether cos (..., T, r/2) broadcasts to x's rows without growing them (the result is written into x)."""
    return x.dim() == cos.dim() and all(c in (1, n) for c, n in zip(cos.shape[:-1], x.shape[:-1]))


def partial_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int,
    layout: str = "half", force: bool = False,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Rotate q and k in place when it is safe; None when the caller must use the reference.

    Under autograd (grad enabled and q or k requiring grad) both must pass `inplace_target`.
    Without autograd only `force` rotates in place (the caller then owns q and k)."""
    if rotary_dims == 0:
        return q, k
    if not (_broadcasts_into(cos, q) and _broadcasts_into(cos, k)):
        return None
    rotation = functools.partial(rotate_qk_, cos=cos, sin=sin, rotary_dims=rotary_dims, layout=layout)
    return rotate_in_place(q, k, rotation, force)


def rotate_in_place(
    q: torch.Tensor, k: torch.Tensor, rotation: Rotation, force: bool = False,
) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Apply `rotation` to q and k in place when it is safe (see `partial_rotary`); None otherwise."""
    if _shares_memory(q, k):
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        targets = inplace_target(q), inplace_target(k)
        if None in targets or _shares_memory(targets[0][0], targets[1][0]):
            return None
        (q_target, q_geom), (k_target, k_geom) = targets
        if q_geom is not None and q._view_func(q_target).stride() != q.stride():
            return None
        if k_geom is not None and k._view_func(k_target).stride() != k.stride():
            return None
        q_out, k_out = PartialRotary.apply(q_target, k_target, rotation, q_geom, k_geom)
        # Views of the rotated bases with q's and k's own shapes and strides
        return q_out if q_geom is None else _view_like(q, q_out), k_out if k_geom is None else _view_like(k, k_out)
    if not force:
        return None
    rotation(q, k, inverse=False)
    return q, k
