"""`RotaryEmbedding`: RoPE for one layer setting, as the model uses it: frequencies, an optional cos/sin
table, and the rotation of q and k (in place when that is safe, else the reference).

Under torch.compile the reference is traced (Inductor fuses it) and cos/sin are computed from the
positions instead of the table, so the model compiles without graph breaks.
"""

from __future__ import annotations

import weakref
from typing import Optional

import numpy as np
import torch
from torch import nn

from ropelab.config.position import POSITION_TYPES
from ropelab.config.rope import RopeConfig, RopeScalingConfig
from ropelab.rope.cpu_kernel import available as cpu_kernel_available, supports as cpu_supports
from ropelab.rope.cpu_kernel import supports_positions as cpu_supports_positions
from ropelab.rope.frequencies import layer_frequencies, rope_angles, table_cache_bytes
from ropelab.rope.inplace import Rotation, partial_rotary, rotate_in_place
from ropelab.rope.kernels import rotate_, rotate_qk_at_positions_, triton_kernels
from ropelab.rope.pairs import kept_pairs
from ropelab.rope.reference import apply_partial_rope
from ropelab.rope.scaling import attention_factor as scaling_attention_factor, length_dependent


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

    With `config.scaling` (`ropelab.rope.scaling`) the frequencies are the scaled ones and cos/sin
    (table or on the fly) carry the attention factor, as HF's do. Dynamic NTK and LongRoPE depend on
    the length L = largest position + 1 of each call: the frequencies (and the one table) are those
    of the last call's L, recomputed only when L changes them: for dynamic NTK up to
    original_max_position one table serves every length, beyond it each new L rebuilds the table
    (0..L-1); LongRoPE keeps one table until L crosses original_max_position. Unlike HF, which keeps
    the largest L seen until a call shorter than the original context resets it, the result of a
    call depends on its own positions only.

    A subclass for another rotation names its registered type (`ropelab.config.position`); where that
    type declares no `fast_kernels` (its cos/sin are not plain cos/sin of position x frequency, or
    carry learned parameters) only the reference rotation runs, whatever `inplace` says."""

    position_type = "rope"

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
    def fast_paths(self) -> bool:
        """Whether the in-place rotation and the C and Triton kernels may run (declared by the type)."""
        return POSITION_TYPES[self.position_type].fast_kernels and self.inplace is not False

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor,
                in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
        ``inplace = True``, or the caller's ``in_place`` (q and k are its own, as `Attention`'s are
        in an inference forward), also rotates tensors that need no grad in place.
        ``inplace = False`` always uses the reference."""
        if self.rotary_dims == 0:
            return q, k
        if length_dependent(self.config.scaling) and not torch.compiler.is_compiling():
            self._follow_length(position_ids)  # before a kernel reads the frequencies or the table
        if self.per_head:
            return self._rotate_per_head(q, k, position_ids, in_place)
        cos_sin = None
        if self.fast_paths and not torch.compiler.is_compiling():
            force = bool(self.inplace) or in_place
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

    def _rotate_per_head(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor,
                         in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for KV heads of their own frequencies: each query head takes its KV group's angles.
        In place (same rules as `forward`) with the eager rotation, else the reference."""
        cos_k, sin_k = self.cos_sin(position_ids)  # (B or 1, K, T, r/2)
        K, group = k.shape[1], q.shape[1] // k.shape[1]
        r, layout = self.rotary_dims, self.layout
        if self.fast_paths and not torch.compiler.is_compiling():
            cos_g, sin_g = cos_k.unsqueeze(2), sin_k.unsqueeze(2)  # (., K, 1, T, r/2): broadcast over a group

            def rotation(q: torch.Tensor, k: torch.Tensor, inverse: bool = False) -> None:
                rotate_(q.unflatten(1, (K, group)), cos_g, sin_g, r, layout, inverse)  # a view: q rotates in place
                rotate_(k, cos_k, sin_k, r, layout, inverse)

            rotated = rotate_in_place(q, k, rotation, bool(self.inplace) or in_place)
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
