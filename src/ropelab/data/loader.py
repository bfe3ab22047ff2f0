"""Deterministic, seekable batches of packed windows.

Sample i of the run (counting every sequence of every optimizer step, across ranks) is
window `perm_e[i mod W]` of epoch e = i // W, where W is the number of `seq_len` windows in
the token stream and perm_e a permutation seeded by (seed, e). A batch is therefore a pure
function of (seed, step, micro-step, rank): a resumed run sees exactly the data it would
have seen, and ranks never overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ropelab.data.tokens import TokenSplit


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    labels: torch.Tensor  # (B, T) long, -100 where no loss
    position_ids: torch.Tensor  # (B, T) long
    doc_ids: torch.Tensor  # (B, T) long, document index within the split

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in (self.input_ids, self.labels, self.position_ids, self.doc_ids)))


class PackedLoader:
    def __init__(self, split: TokenSplit, seq_len: int, seed: int = 0, positions: str = "running"):
        self.split = split
        self.seq_len = seq_len
        self.seed = seed
        self.positions = positions
        self.num_windows = (split.num_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"split has {split.num_tokens} tokens, fewer than one window of {seq_len + 1}")

    @lru_cache(maxsize=4)
    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def window(self, window_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        T = self.seq_len
        start = window_index * T
        chunk = np.asarray(self.split.tokens[start : start + T + 1], dtype=np.int64)
        offsets = self.split.doc_offsets
        doc = np.searchsorted(offsets, np.arange(start, start + T), side="right") - 1
        if self.positions == "running":
            pos = np.arange(T)
        else:  # restart at each document start (a document begun before the window counts from the window edge)
            doc_start = np.maximum(offsets[doc], start)
            pos = np.arange(start, start + T) - doc_start
        return chunk[:-1], chunk[1:], pos, doc

    def sample_windows(self, first_sample: int, count: int) -> list[int]:
        out = []
        for i in range(first_sample, first_sample + count):
            epoch, offset = divmod(i, self.num_windows)
            out.append(int(self._permutation(epoch)[offset]))
        return out

    def collate(self, windows: list[int]) -> Batch:
        parts = [self.window(w) for w in windows]
        return Batch(*(torch.from_numpy(np.stack([p[i] for p in parts])) for i in range(4)))

    def batch(self, step: int, micro_step: int, micro_batch: int, grad_accum: int, rank: int = 0, world: int = 1) -> Batch:
        """Micro-batch `micro_step` of optimizer step `step` for data-parallel `rank`."""
        global_batch = micro_batch * grad_accum * world
        first = step * global_batch + (micro_step * world + rank) * micro_batch
        return self.collate(self.sample_windows(first, micro_batch))

    def sequential(self, count: int, micro_batch: int):
        """The first `count` windows in order, in micro-batches (validation)."""
        count = min(count, self.num_windows)
        for start in range(0, count, micro_batch):
            yield self.collate(list(range(start, min(start + micro_batch, count))))
