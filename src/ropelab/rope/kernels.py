"""The in-place rotation of q and k and the fastest kernel that applies (`rotate_qk_`):

  * CUDA with Triton: `ropelab.rope.triton_kernel`, one kernel for q and k; with the ``table`` cache it
    looks the positions up in the table itself, with ``none`` it forms the angles from the positions;
  * CPU: `ropelab.rope.cpu_kernel`, one C loop for q and k (compiled on first use; float32 and bfloat16;
    off with ROPELAB_CPU_KERNEL=0); with the ``table`` cache it too looks the positions up itself;
  * otherwise `rotate_`, eager PyTorch per tensor: ``half`` pairs take four elementwise passes,
    float32 ``interleaved`` pairs one complex multiplication (see BENCHMARKS.md).
Only the first ``rotary_dims`` channels are read or written; none of these functions records autograd
(`ropelab.rope.inplace` wraps them in one autograd node).
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

from ropelab.rope.cpu_kernel import rotate_ as cpu_rotate_


def _pairs(x: torch.Tensor, rotary_dims: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the two members of every rotated pair of x (..., D): each (..., rotary_dims/2)."""
    if layout == "half":
        half = rotary_dims // 2
        return x[..., :half], x[..., half:rotary_dims]
    return x[..., 0:rotary_dims:2], x[..., 1:rotary_dims:2]


def _rotate_pairs_(x1: torch.Tensor, x2: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    """(x1, x2) <- (x1 cos - x2 sin, x2 cos + x1 sin) in place; by -angle when `inverse`.

    float32: four elementwise passes over rotary_dims/2 channels, writing straight into x1 and
    x2 (one temporary, x1 sin). Other dtypes are computed in float32, like `rotate`, on float32
    copies of the rotated channels, and rounded once on the way back."""
    if x1.dtype == torch.float32:
        sign = -1.0 if inverse else 1.0
        a = x1 * sin
        x1.mul_(cos).addcmul_(x2, sin, value=-sign)  # x1 cos -+ x2 sin
        if inverse:
            a.neg_()  # exact; the elementwise ops below then match (x2 cos - x1 sin) of the reference
        torch.addcmul(a, x2, cos, out=x2)  # x2 cos +- x1 sin, written in place (out aliases x2 exactly)
        return
    sign = -1.0 if inverse else 1.0
    f1, f2 = x1.float(), x2.float()  # float32 copies of the rotated channels only
    n1 = f1 * cos
    n1.addcmul_(f2, sin, value=-sign)  # x1 cos -+ x2 sin
    x1.copy_(n1)
    f2.mul_(cos).addcmul_(f1, sin, value=sign)  # x2 cos +- x1 sin
    x2.copy_(f2)


def _as_complex_pairs(x: torch.Tensor, rotary_dims: int) -> Optional[torch.Tensor]:
    """The interleaved pairs of x[..., :rotary_dims] as a complex64 view, or None if x does not allow it."""
    if x.dtype != torch.float32 or x.stride(-1) != 1 or x.storage_offset() % 2:
        return None
    if any(stride % 2 for stride in x.stride()[:-1]):
        return None
    return torch.view_as_complex(x[..., :rotary_dims].unflatten(-1, (rotary_dims // 2, 2)))


def rotate_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, layout: str = "half",
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate the first `rotary_dims` channels of x (..., T, D) in place (no autograd); returns x.

    Only those channels are read or written. `inverse` rotates by -angle (the transpose).
    Interleaved float32 pairs are adjacent, so they are rotated as one complex multiplication."""
    if not rotary_dims:
        return x
    if layout != "half":
        pairs = _as_complex_pairs(x, rotary_dims)
        if pairs is not None:
            pairs.mul_(torch.complex(cos, -sin if inverse else sin))
            return x
    _rotate_pairs_(*_pairs(x, rotary_dims, layout), cos, sin, inverse)
    return x


@functools.cache
def triton_kernels():
    """The sibling module `triton_kernel` when CUDA is available and Triton imports, else None.

    Imported by name, not by an import statement, so that Hugging Face exports (which ship this
    file and what it imports, see `ropelab.export.remote_code`) neither ship it nor require Triton."""
    if not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module(".triton_kernel", __package__)
    except ImportError:
        return None


def rotate_qk_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, layout: str = "half",
    inverse: bool = False,
) -> None:
    """Rotate the first `rotary_dims` channels of q and k in place with the fastest kernel that applies:
    Triton on CUDA, the C loop on CPU (`cpu_kernel`), else `rotate_` on each. q and k must not overlap."""
    triton = triton_kernels() if q.is_cuda else None
    if triton is not None and triton.supports(q, k):
        triton.rotate_qk_(q, k, rotary_dims=rotary_dims, layout=layout, inverse=inverse, cos=cos, sin=sin)
    elif not cpu_rotate_((q, k), cos, sin, rotary_dims, layout, inverse):
        rotate_(q, cos, sin, rotary_dims, layout, inverse)
        rotate_(k, cos, sin, rotary_dims, layout, inverse)


def rotate_qk_at_positions_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    rotary_dims: int, layout: str = "half", inverse: bool = False,
) -> None:
    """`rotate_qk_` with the angles of table rows `positions` (B or 1, T) on CPU, every position in
    [0, len(table)). The C loop looks the rows up itself (no cos/sin per token is gathered); where it
    declines (e.g. a gradient whose channels are not contiguous) the rows are gathered."""
    if not cpu_rotate_((q, k), cos_table, sin_table, rotary_dims, layout, inverse, positions=positions):
        rotate_qk_(q, k, cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1), rotary_dims, layout,
                   inverse)
