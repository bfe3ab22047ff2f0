"""Rotary position embedding: the one place where RoPE math lives.

Conventions (see `RopeConfig` for the user-facing description):
  * only the first ``rotary_dims`` channels of each query/key head rotate; the rest pass
    through untouched (bit-identical);
  * ``rotary_dims = 2 * floor(fraction * head_dim / 2)``, at least 2 for fraction > 0;
  * ``slice`` frequencies ``theta^(-2i/rotary_dims)``, ``truncate`` ``theta^(-2i/head_dim)``,
    for i in [0, rotary_dims/2);
  * ``half`` pairs channel i with i + rotary_dims/2, ``interleaved`` pairs 2i with 2i+1;
  * angles are formed in float64 (exact for positions far beyond 2^24) and cos/sin are
    stored in float32 whatever the model dtype.

Two implementations of the same rotation:
  * `apply_partial_rope` (reference, out of place): rotates a slice and concatenates the
    pass-through channels back, so it reads and writes every channel whatever the fraction;
  * `PartialRotary` (fast path, in place): overwrites only the first ``rotary_dims`` channels
    of q and k, in one autograd node, and its backward rotates only the same channels of the
    incoming gradient back (by -angle), in place. Work scales with the fraction; fraction 0
    does nothing. `RotaryEmbedding.forward` picks it when that is safe (see `inplace_target`).
The in-place rotation itself runs on the fastest kernel that applies (`rotate_qk_`):
  * CUDA with Triton: `rope_triton`, one kernel for q and k; with the ``table`` cache it looks the
    positions up in the table itself, with ``none`` it forms the angles from the positions;
  * CPU: `rope_cpu`, one C loop for q and k (compiled on first use; float32 and bfloat16; off
    with ROPELAB_CPU_KERNEL=0); with the ``table`` cache it too looks the positions up itself;
  * otherwise `rotate_`, eager PyTorch per tensor: ``half`` pairs take four elementwise passes,
    float32 ``interleaved`` pairs one complex multiplication (see BENCHMARKS.md).
Under torch.compile the reference is traced (Inductor fuses it) and cos/sin are computed from
the positions instead of the table, so the model compiles without graph breaks.
"""

from __future__ import annotations

import functools
import importlib
import math
import weakref
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from ropelab.config import RopeConfig, RopeScalingConfig
from ropelab.rope_cpu import available as cpu_kernel_available, rotate_ as cpu_rotate_, supports as cpu_supports
from ropelab.rope_cpu import supports_positions as cpu_supports_positions
from ropelab.rope_pairs import kept_pairs
from ropelab.rope_scaling import attention_factor as scaling_attention_factor, length_dependent, scale_frequencies
from ropelab.rope_scaling import spectrum_dims

# (q, k, inverse) -> None: rotates the rotary channels of q and k in place (see `rotate_qk_`).
Rotation = Callable[..., None]


def inverse_frequencies(
    rotary_dims: int, head_dim: int, theta: float, style: str = "slice", precision: str = "float64"
) -> torch.Tensor:
    """Angular frequency of each rotated pair, shape (rotary_dims/2,), float64. With `precision`
    float32 they are computed in float32 as HF transformers does (and held as float64 of those values)."""
    denominator = rotary_dims if style == "slice" else head_dim
    dtype = torch.float32 if precision == "float32" else torch.float64
    exponents = torch.arange(0, rotary_dims, 2, dtype=dtype) / denominator
    return (1.0 / (float(theta) ** exponents)).to(torch.float64)


def layer_frequencies(config: RopeConfig, head_dim: int, kv_heads: int = 1, seq_len=None) -> torch.Tensor:
    """Inverse frequencies of a layer's rotated pairs, float64: (rotary_dims/2,) when every head turns
    alike, (kv_heads, r) when a selected-pair plan keeps other pairs in each KV head. A plan's pairs keep
    their full-head frequencies ``theta^(-2i/head_dim)``. With `config.scaling` they are then scaled by
    its method (`ropelab.rope_scaling`), dynamic NTK and LongRoPE at length `seq_len` (an int or a 0-d
    tensor; None: the original context)."""
    plan = kept_pairs(config, head_dim, kv_heads)
    if plan is None:
        inv_freq = inverse_frequencies(config.resolve_dims(head_dim), head_dim, config.theta, config.style,
                                       config.angles)
    else:
        spectrum = inverse_frequencies(head_dim, head_dim, config.theta, "slice", config.angles)
        same = all(heads == plan[0] for heads in plan)
        inv_freq = spectrum[torch.tensor(plan[0] if same else plan, dtype=torch.long)]  # (r,) or (K, r)
    if config.scaling is None:
        return inv_freq
    dim = spectrum_dims(config.resolve_dims(head_dim), head_dim, config.style, config.has_plan)
    return scale_frequencies(inv_freq, dim, config.theta, config.scaling, seq_len)[0]


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, precision: str = "float64"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, shape positions.shape + inv_freq.shape, float32.

    The product is formed and reduced modulo 2*pi in float64, so positions up to about 2^32
    keep their angle exact to float32 precision (float32 angles lose it beyond 2^24 tokens).
    `precision` float32 forms it in float32 instead, as HF transformers does (for parity with it)."""
    shape = positions.shape + inv_freq.shape
    if precision == "float32":
        angles = positions.to(torch.float32).reshape(-1, 1) * inv_freq.to(positions.device, torch.float32).reshape(1, -1)
        return angles.cos().reshape(shape), angles.sin().reshape(shape)
    angles = positions.to(torch.float64).reshape(-1, 1) * inv_freq.to(positions.device, torch.float64).reshape(1, -1)
    angles = torch.remainder(angles, 2 * math.pi)
    return angles.cos().to(torch.float32).reshape(shape), angles.sin().to(torch.float32).reshape(shape)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate every pair of `x` (..., T, rotary_dims) by angles given as cos/sin (..., T, rotary_dims/2).

    Computed in float32 and returned in x's dtype."""
    dtype = x.dtype
    x = x.float()
    if layout == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(dtype)


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, layout: str = "half"
) -> torch.Tensor:
    """Rotate the first `rotary_dims` channels of x (B, H, T, D); the others are returned as they are."""
    if rotary_dims == 0:
        return x
    if rotary_dims == x.shape[-1]:
        return rotate(x, cos, sin, layout)
    return torch.cat((rotate(x[..., :rotary_dims], cos, sin, layout), x[..., rotary_dims:]), dim=-1)


# ------------------------------------------------------------------ in-place fast path


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
    """The sibling module `rope_triton` when CUDA is available and Triton imports, else None.

    Imported by name, not by an import statement, so that Hugging Face exports (which ship this
    file and what it imports, see `evaluate.remote_code`) neither ship it nor require Triton."""
    if not torch.cuda.is_available():
        return None
    try:
        return importlib.import_module(".rope_triton", __package__)
    except ImportError:
        return None


def rotate_qk_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, layout: str = "half",
    inverse: bool = False,
) -> None:
    """Rotate the first `rotary_dims` channels of q and k in place with the fastest kernel that applies:
    Triton on CUDA, the C loop on CPU (`rope_cpu`), else `rotate_` on each. q and k must not overlap."""
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
        # Views of the rotated bases with q's and k's own shapes (view ops replayed: cheap backward).
        return (q_out if q_geom is None else q._view_func(q_out), k_out if k_geom is None else k._view_func(k_out))
    if not force:
        return None
    rotation(q, k, inverse=False)
    return q, k


def _shared_run_start(position_ids: torch.Tensor) -> Optional[int]:
    """s when every row of CPU position_ids (B, T) is s, s + 1, ..., s + T - 1 (running positions);
    else None. In numpy: a few torch ops on 2k elements cost more than the rotation saves."""
    ids = position_ids.numpy()
    start = int(ids[0, 0])
    return start if start >= 0 and bool((ids == np.arange(start, start + ids.shape[1])).all()) else None


def _made_for(memo: Optional[tuple], position_ids: torch.Tensor) -> bool:
    """Whether `memo` (weak reference, version, ...) was made for this very position tensor, unchanged since."""
    return memo is not None and memo[0]() is position_ids and memo[1] == position_ids._version


class RotaryEmbedding(nn.Module):
    """RoPE for one layer setting: frequencies, an optional cos/sin table, and the rotation.

    Layers whose settings are equal share one instance (see `Transformer`).

    With `config.scaling` (`ropelab.rope_scaling`) the frequencies are the scaled ones and cos/sin
    (table or on the fly) carry the attention factor, as HF's do. Dynamic NTK and LongRoPE depend on
    the length L = largest position + 1 of each call: the frequencies (and the one table) are those
    of the last call's L, recomputed only when L changes them: for dynamic NTK up to
    original_max_position one table serves every length, beyond it each new L rebuilds the table
    (0..L-1); LongRoPE keeps one table until L crosses original_max_position. Unlike HF, which keeps
    the largest L seen until a call shorter than the original context resets it, the result of a
    call depends on its own positions only."""

    def __init__(self, config: RopeConfig, head_dim: int, kv_heads: int = 1):
        super().__init__()
        self.config = config
        self.head_dim = head_dim
        self.kv_heads = kv_heads
        self.rotary_dims = config.resolve_dims(head_dim)
        self.layout = config.layout
        # Plain attributes, not buffers: `model.to(torch.bfloat16)` must not cast them.
        # (r,), or (kv_heads, r) for a plan whose KV heads keep different pairs (`per_head`).
        self.inv_freq = layer_frequencies(config, head_dim, kv_heads)
        self.attention_factor = scaling_attention_factor(config.scaling)
        self._length_key = None  # what the length-dependent frequencies were made for (`_follow_length`)
        self.cos_table: Optional[torch.Tensor] = None
        self.sin_table: Optional[torch.Tensor] = None
        # None: in place when safe (training); True: also without grad (inference); False: never.
        self.inplace: Optional[bool] = None
        # The last position ids seen (weakly held, with their version) and their cos/sin, and the
        # last ones checked for a kernel that looks them up itself, with their range: the layers
        # that share this module do either once per forward.
        self._last: Optional[tuple] = None
        self._last_range: Optional[tuple] = None

    @property
    def theta(self) -> float:
        return self.config.theta

    @property
    def per_head(self) -> bool:
        """Whether KV heads turn at different frequencies (a selected-pair plan chosen per head)."""
        return self.inv_freq.dim() == 2

    def set_theta(self, theta: float) -> None:
        """Switch RoPE base (e.g. between training phases); drops any cached table."""
        if not theta > 0:
            raise ValueError(f"rope theta must be > 0, got {theta}")
        self.config.theta = float(theta)
        self._refresh()

    def set_scaling(self, scaling: Optional[RopeScalingConfig]) -> None:
        """Switch context extension (a `RopeScalingConfig`, validated; None: off), e.g. YaRN for a
        long-context training phase; drops any cached table."""
        self.config.scaling = scaling
        self._refresh()

    def _refresh(self, seq_len: Optional[int] = None) -> None:
        """Frequencies and attention factor from the config (at length `seq_len`, see `_follow_length`)."""
        self.inv_freq = layer_frequencies(self.config, self.head_dim, self.kv_heads, seq_len)
        self.attention_factor = scaling_attention_factor(self.config.scaling)
        self._length_key = None
        self.cos_table = self.sin_table = None
        self._last = None

    def _follow_length(self, position_ids: torch.Tensor) -> None:
        """Dynamic NTK and LongRoPE: the frequencies of this call's length L (largest position + 1),
        recomputed (and the table dropped) only when L changes them (see the class docstring)."""
        length = self._range(position_ids)[1] + 1
        scaling = self.config.scaling
        original = scaling.original_max_position
        key = max(length, original) if scaling.method == "dynamic" else length > original
        if key != self._length_key:
            self._refresh(length)
            self._length_key = key

    def _rope_angles(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_angles` times the attention factor: cos and sin of the rotated channels only, as HF scales them."""
        cos, sin = rope_angles(positions, inv_freq, self.config.angles)
        if self.attention_factor != 1:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _table(self, needed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin table, grown to cover positions 0..needed-1; each (positions, rotary_dims/2), or
        (positions, kv_heads, rotary_dims/2) `per_head`."""
        if self.cos_table is None or self.cos_table.shape[0] < needed or self.cos_table.device != device:
            size = max(needed, 0 if self.cos_table is None else self.cos_table.shape[0])
            self.cos_table, self.sin_table = self._rope_angles(torch.arange(size, device=device), self.inv_freq)
        return self.cos_table, self.sin_table

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for position ids (B, T) -> each (B or 1, 1, T, rotary_dims/2), float32."""
        if torch.compiler.is_compiling():
            # Under torch.compile the table's data-dependent size (max position) would break the
            # graph; the angles of the positions themselves are the same numbers the table holds.
            return self._angles(position_ids)
        if length_dependent(self.config.scaling):
            self._follow_length(position_ids)
        if _made_for(self._last, position_ids):
            return self._last[2]
        cos_sin = self._cos_sin(position_ids)
        self._last = (weakref.ref(position_ids), position_ids._version, cos_sin)
        return cos_sin

    def _heads_axis(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (B, T, r/2) -> (B, 1, T, r/2); `per_head` (B, T, K, r/2) -> (B, K, T, r/2)."""
        if self.per_head:
            return cos.transpose(-3, -2), sin.transpose(-3, -2)
        return cos.unsqueeze(-3), sin.unsqueeze(-3)

    def _angles(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if length_dependent(self.config.scaling) and torch.compiler.is_compiling():  # the length as a tensor
            inv_freq = layer_frequencies(self.config, self.head_dim, self.kv_heads, position_ids.max() + 1)
        return self._heads_axis(*self._rope_angles(position_ids, inv_freq))

    def _cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Per-head plans form their few angles (kv_heads x r per token) on every call: a table per layer
        # (plans differ by layer) would hold more than the source's one shared table.
        if self.config.cache == "none" or self.per_head:
            return self._angles(position_ids)
        start = _shared_run_start(position_ids) if position_ids.device.type == "cpu" else None
        if start is not None:  # every row start, start + 1, ...: a slice of the table, no gather
            T = position_ids.shape[-1]
            cos_table, sin_table = self._table(start + T, position_ids.device)
            return self._heads_axis(cos_table[start: start + T][None], sin_table[start: start + T][None])
        tables = self._tables_for(position_ids)
        if tables is None:  # a negative position (e.g. a left pad): no table row holds it, so form the angles
            return self._angles(position_ids)
        return self._heads_axis(tables[0][position_ids], tables[1][position_ids])

    def _tables_for(self, position_ids: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The cos/sin tables grown to cover position_ids; None if a position is negative (no table
        row holds it)."""
        low, high = self._range(position_ids)
        return None if low < 0 else self._table(high + 1, position_ids.device)

    def _range(self, position_ids: torch.Tensor) -> tuple[int, int]:
        """(smallest, largest) position; the check (one pass) runs once per position tensor, not once per layer."""
        if not _made_for(self._last_range, position_ids):
            low, high = torch.aminmax(position_ids)
            self._last_range = (weakref.ref(position_ids), position_ids._version, int(low), int(high))
        return self._last_range[2:]

    def _kernel_rotation(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> Optional[Rotation]:
        """A rotation whose kernel takes each token's angles by its position, so that no cos/sin per
        token is formed: Triton on CUDA (table lookup, or angles formed from the frequencies with
        cache none), the C loop on CPU (table cache). None where neither applies."""
        triton = triton_kernels()
        if triton is not None and triton.supports(q, k, position_ids):  # CUDA tensors (or Triton's interpreter)
            kernel = triton.rotate_qk_
        elif self.config.cache == "table" and cpu_kernel_available() and all(
            cpu_supports(x) and cpu_supports_positions(position_ids, x) for x in (q, k)
        ):
            kernel = rotate_qk_at_positions_
        else:
            return None
        if self.config.cache == "none":
            if self.attention_factor != 1:  # the kernel forms cos/sin from the frequencies, without the factor
                return None
            angles = {"inv_freq": self.inv_freq}
        else:
            tables = self._tables_for(position_ids)
            if tables is None:
                return None
            angles = {"cos_table": tables[0], "sin_table": tables[1]}
        version = position_ids._version

        def rotation(q: torch.Tensor, k: torch.Tensor, inverse: bool = False) -> None:
            # Backward reads the positions again: edited in place since, they might lie past the table.
            if position_ids._version != version:
                raise RuntimeError("RoPE: the position ids were modified in place between the forward pass that "
                                   "used them and its backward pass; clone them before editing")
            kernel(q, k, rotary_dims=self.rotary_dims, layout=self.layout, inverse=inverse, positions=position_ids,
                   **angles)

        return rotation

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, Hq, T, D), k (B, Hk, T, D), position_ids (B, T) -> rotated q, k.

        With ``inplace`` None (auto) q and k are rotated in place, by `PartialRotary`, when
        autograd guarantees that is safe: both are non-leaf tensors requiring grad (the fresh
        outputs of projections, as in `Attention`), or views of such tensors, and they share
        no memory. Then the tensors passed in hold the rotated values afterwards. Otherwise
        (no grad, leaf tensors, q and k aliasing, under torch.compile) the reference
        `apply_partial_rope` returns new tensors and leaves the inputs alone. Both give the
        same numbers up to float32 rounding (the CPU kernel gives the reference's bits; the
        torch path differs in the last bit from fused multiply-adds); pass-through channels
        are bit-identical either way.
        ``inplace = True`` also rotates tensors that need no grad in place (inference).
        ``inplace = False`` always uses the reference."""
        if self.rotary_dims == 0:
            return q, k
        if length_dependent(self.config.scaling) and not torch.compiler.is_compiling():
            self._follow_length(position_ids)  # before a kernel reads the frequencies or the table
        if self.per_head:
            return self._rotate_per_head(q, k, position_ids)
        cos_sin = None
        if self.inplace is not False and not torch.compiler.is_compiling():
            force = bool(self.inplace)
            rotation = self._kernel_rotation(q, k, position_ids)
            if rotation is not None:
                rotated = rotate_in_place(q, k, rotation, force)
            else:
                cos_sin = self.cos_sin(position_ids)
                rotated = partial_rotary(q, k, *cos_sin, self.rotary_dims, self.layout, force)
            if rotated is not None:
                return rotated
        cos, sin = cos_sin or self.cos_sin(position_ids)
        return (
            apply_partial_rope(q, cos, sin, self.rotary_dims, self.layout),
            apply_partial_rope(k, cos, sin, self.rotary_dims, self.layout),
        )

    def _rotate_per_head(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for KV heads of their own frequencies: each query head takes its KV group's angles.
        In place (same rules as `forward`) with the eager rotation, else the reference."""
        cos_k, sin_k = self.cos_sin(position_ids)  # (B or 1, K, T, r/2)
        K, group = k.shape[1], q.shape[1] // k.shape[1]
        r, layout = self.rotary_dims, self.layout
        if self.inplace is not False and not torch.compiler.is_compiling():
            cos_g, sin_g = cos_k.unsqueeze(2), sin_k.unsqueeze(2)  # (., K, 1, T, r/2): broadcast over a group

            def rotation(q: torch.Tensor, k: torch.Tensor, inverse: bool = False) -> None:
                rotate_(q.unflatten(1, (K, group)), cos_g, sin_g, r, layout, inverse)  # a view: q rotates in place
                rotate_(k, cos_k, sin_k, r, layout, inverse)

            rotated = rotate_in_place(q, k, rotation, bool(self.inplace))
            if rotated is not None:
                return rotated
        cos_q, sin_q = cos_k.repeat_interleave(group, dim=1), sin_k.repeat_interleave(group, dim=1)  # (., H, T, r/2)
        return apply_partial_rope(q, cos_q, sin_q, r, layout), apply_partial_rope(k, cos_k, sin_k, r, layout)

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cos_table, self.sin_table) if t is not None)

    def table_bytes(self, seq_len: int) -> int:
        """Bytes the cos/sin table holds once positions 0..seq_len-1 have been seen (0: no table)."""
        if self.config.cache == "none" or self.per_head:
            return 0
        return table_cache_bytes(seq_len, self.rotary_dims)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"rotary_dims={self.rotary_dims}/{self.head_dim} (fraction {self.rotary_dims / self.head_dim:.3f}), "
            f"theta={c.theta:g}, style={c.style}, layout={c.layout}, cache={c.cache}"
            + (f", pairs={kept_pairs(c, self.head_dim, self.kv_heads)}" if c.has_plan else "")
        )


def table_cache_bytes(seq_len: int, rotary_dims: int, dtype_bytes: int = 4) -> int:
    """Bytes of a cos+sin table for `seq_len` positions: 2 tables x seq_len x rotary_dims/2."""
    return 2 * seq_len * (rotary_dims // 2) * dtype_bytes

