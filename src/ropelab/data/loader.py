"""Deterministic, seekable batches of packed windows.

A split's token stream (documents back to back, EOS after each) is cut into `seq_len` windows:
  * ``pack=cross``: window w is tokens [w*T, (w+1)*T); documents run across window edges;
  * ``pack=whole``: documents go into windows whole, in stream order; when the next one does not
    fit, the rest of the window is padding. A document longer than T is cut into T-token pieces.
    Windows do not span shards.
Sample i of the run (counting every sequence of every optimizer step, across ranks) is window
``perm_e[i mod W]`` of epoch e = i // W, where W is the number of windows and perm_e a permutation
seeded by (seed, e). A batch is therefore a pure function of (seed, step, micro-step, rank): a
resumed run sees exactly the data it would have seen, and ranks never overlap.

Labels are the next token of the stream; -100 (no loss) on padding, after the end of the split
and, with `mask_boundary_labels`, on each document's last token, whose target would be the next
document's first. Position ids run over the window, or restart at each document (a document
begun before the window counts from the window edge). `doc_ids` number documents across the
split (padding is -1); `cu_seqlens` marks the same segments over the flattened batch.

`max_doc_len` turns long documents into short ones: each document is cut into pieces of at most
that many tokens, and every piece counts as a document of its own for the document mask,
restarting positions and boundary labels (its id is then its first stream position; no EOS is
inserted between pieces). Packed into long windows with running positions, that is the
distillation seed's "short data, long context" phase built from any corpus.

`copy_span` (training windows): in a share `copy_share` of the windows, chosen by (seed, window), a
span of that many tokens is copied from a random place to a random later one, overwriting what was
there; inputs and labels both read the changed tokens. A tiny model trained on plain text uses little
of its window (the distillation teacher's measurement: no gain beyond 64 tokens); a span met again
rewards looking back as far as the window reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from ropelab.attention import Documents
from ropelab.config import ConfigError
from ropelab.data.tokens import TokenSplit

PAD_DOC = -1


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    labels: torch.Tensor  # (B, T) long, -100 where no loss
    position_ids: torch.Tensor  # (B, T) long
    doc_ids: torch.Tensor  # (B, T) long, document number within the split, -1 on padding
    cu_seqlens: Optional[torch.Tensor] = None  # (segments + 1,) int32 over the flattened B*T tokens

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.labels), move(self.position_ids), move(self.doc_ids), move(self.cu_seqlens))


def whole_windows(split: TokenSplit, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(first stream position, token count) of every pack=whole window, greedily filled in order:
    each window ends at the last document end within `seq_len` tokens, or, when the document at its
    start is longer than that, `seq_len` tokens in (a piece of it)."""
    starts, lengths = [], []
    for base, shard in zip(split.token_bases, split.shards):
        edges = _greedy_edges(np.asarray(shard.doc_offsets, dtype=np.int64), seq_len)
        starts.append(int(base) + edges[:-1])
        lengths.append(np.diff(edges))
    if not starts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(starts), np.concatenate(lengths)


def _greedy_edges(offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """Window edges of one shard. A greedy window can only end at a document end or, inside a
    document longer than `seq_len`, at its start + k * seq_len; from each such cut the farthest one
    within reach is found for all cuts at once, and the windows are the chain of jumps from 0
    (a Python step per window, no search)."""
    inside = np.maximum((np.diff(offsets) - 1) // seq_len, 0)  # cuts strictly inside each document
    first = np.repeat(np.cumsum(inside) - inside, inside)
    pieces = np.repeat(offsets[:-1], inside) + (np.arange(len(first)) - first + 1) * seq_len
    cuts = np.sort(np.concatenate([offsets, pieces]), kind="stable")  # two sorted runs: cheap to merge
    cuts = cuts[np.concatenate([[True], cuts[1:] != cuts[:-1]])]  # empty documents repeat an offset
    farthest = (np.searchsorted(cuts, cuts + seq_len, side="right") - 1).tolist()
    chain, i, last = [0], 0, len(cuts) - 1
    while i < last:
        i = farthest[i]
        chain.append(i)
    return cuts[chain]


class PackedLoader:
    def __init__(
        self,
        split: TokenSplit,
        seq_len: int,
        seed: int = 0,
        positions: str = "running",
        pack: str = "cross",
        mask_boundary_labels: bool = False,
        pad_id: int = 0,
        name: str = "split",
        max_doc_len: Optional[int] = None,
        copy_span: Optional[int] = None,
        copy_share: float = 0.5,
    ):
        self.split = split
        self.seq_len = seq_len
        self.seed = seed
        self.epoch_order: Optional[tuple[int, np.ndarray]] = None  # (epoch, its window order): `_permutation`
        self.positions = positions
        self.pack = pack
        self.mask_boundary_labels = mask_boundary_labels
        self.pad_id = pad_id
        self.max_doc_len = max_doc_len
        self.copy_span = copy_span
        self.copy_share = copy_share
        if pack == "cross":
            self.num_windows = (split.num_tokens - 1) // seq_len
        else:
            self.starts, self.lengths = whole_windows(split, seq_len)
            self.num_windows = len(self.starts)
        if self.num_windows < 1:
            raise ConfigError(f"{name}: {split.num_tokens} tokens, fewer than one window of {seq_len + 1}; lower data.seq_len or add data")

    def _permutation(self, epoch: int) -> np.ndarray:
        """The window order of `epoch`, kept per loader for the epoch last asked (a cache shared by every
        loader, as `lru_cache` on a method is, was drawn anew on every call of a stack's interleaved members)."""
        if self.epoch_order is None or self.epoch_order[0] != epoch:
            self.epoch_order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_windows))
        return self.epoch_order[1]

    def span(self, window_index: int) -> tuple[int, int]:
        """(first stream position, token count) of a window."""
        if self.pack == "cross":
            return window_index * self.seq_len, self.seq_len
        return int(self.starts[window_index]), int(self.lengths[window_index])

    def window(self, window_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(input ids, labels, position ids, document ids) of one window, each (T,)."""
        T = self.seq_len
        start, n = self.span(window_index)
        tokens = self.split.tokens(start, start + n + 1)  # one past the window for the last label
        if self.copy_span:
            tokens = self.copy_a_span(window_index, tokens)
        doc, doc_start = self.split.locate(start, start + n + 1)
        if self.max_doc_len:
            offset = np.arange(start, start + len(doc)) - doc_start
            doc_start = doc_start + offset // self.max_doc_len * self.max_doc_len
            doc = doc_start
        targets = tokens[1:]
        x = np.full(T, self.pad_id, dtype=np.int64)
        x[:n] = tokens[:n]
        y = np.full(T, -100, dtype=np.int64)
        y[: len(targets)] = targets
        if self.mask_boundary_labels:
            y[: len(targets)][doc[: len(targets)] != doc[1 : len(targets) + 1]] = -100
        ids = np.full(T, PAD_DOC, dtype=np.int64)
        ids[:n] = doc[:n]
        pos = np.arange(T)
        if self.positions == "restart":
            pos[:n] = np.arange(start, start + n) - np.maximum(doc_start[:n], start)
            pos[n:] = np.arange(T - n)
        return x, y, pos, ids

    def copy_a_span(self, window_index: int, tokens: np.ndarray) -> np.ndarray:
        """`tokens` with, in a share `copy_share` of the windows, `copy_span` of them copied from a
        random place to a random later one (the two spans do not overlap)."""
        rng = np.random.default_rng([self.seed, 1, window_index])
        span = self.copy_span
        if rng.random() >= self.copy_share or len(tokens) < 2 * span:
            return tokens
        source = int(rng.integers(0, len(tokens) - 2 * span + 1))
        target = int(rng.integers(source + span, len(tokens) - span + 1))
        tokens = np.array(tokens)
        tokens[target : target + span] = tokens[source : source + span]
        return tokens

    def sample_windows(self, first_sample: int, count: int) -> list[int]:
        out = []
        for i in range(first_sample, first_sample + count):
            epoch, offset = divmod(i, self.num_windows)
            out.append(int(self._permutation(epoch)[offset]))
        return out

    def collate(self, windows: list[int]) -> Batch:
        parts = [self.window(w) for w in windows]
        x, y, pos, ids = (torch.from_numpy(np.stack([p[i] for p in parts])) for i in range(4))
        return Batch(x, y, pos, ids, Documents(ids).cu_seqlens())

    def batch(self, step: int, micro_step: int, micro_batch: int, grad_accum: int, rank: int = 0, world: int = 1) -> Batch:
        """Micro-batch `micro_step` of optimizer step `step` for data-parallel `rank`."""
        global_batch = micro_batch * grad_accum * world
        first = step * global_batch + (micro_step * world + rank) * micro_batch
        return self.collate(self.sample_windows(first, micro_batch))

    def sequential(self, count: int, micro_batch: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
        """The first `count` windows in order, in micro-batches (validation); rank r of `world`
        takes windows r, r + world, ..."""
        mine = list(range(rank, min(count, self.num_windows), world))
        for start in range(0, len(mine), micro_batch):
            yield self.collate(mine[start : start + micro_batch])
