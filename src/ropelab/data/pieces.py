"""Short documents only, provably: a split's documents cut into pieces laid out far apart.

`data.max_doc_len` cuts every document into pieces of at most that many tokens, each a document of its
own for the document mask, positions and boundary labels; but in the split's own order the pieces of
one document stay side by side, so a window longer than a piece still holds a long run of one source
document (and a teacher that reads the window without the mask sees it whole). With
``data.piece_order=apart`` the training split is read as a new stream of the same pieces in which two
pieces of one source document are always at least a window (`gap` tokens) apart: no window then holds
more than `max_doc_len` tokens of any source document. That is the distillation seed's phase 2 (long
windows of "concatenated, independently sampled short documents") built from a corpus of long ones.

The order is greedy and deterministic: at each step the next piece comes from the document with the
most pieces left among those whose last piece ended at least `gap` tokens back (ties: the document
first in the split). When no document is ready, the pieces left (the tail of the longest documents)
are dropped; `dropped_tokens` says how many tokens that was.
"""

from __future__ import annotations

import heapq

import numpy as np

from ropelab.config import ConfigError
from ropelab.data.tokens import TokenSplit, covering_spans


def document_spans(split: TokenSplit) -> list[tuple[int, int]]:
    """(first, end) stream positions of every document of the split, in order."""
    spans = []
    for base, shard in zip(split.token_bases, split.shards):
        offsets = np.asarray(shard.doc_offsets, dtype=np.int64) + int(base)
        spans.extend(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
    return [(a, b) for a, b in spans if b > a]


def apart_order(spans: list[tuple[int, int]], piece_len: int, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """(source start, length) of each piece in the new order: every span cut into `piece_len`-token
    pieces, two pieces of one span at least `gap` tokens apart in the new stream."""
    pieces = [[(a, min(piece_len, end - a)) for a in range(start, end, piece_len)][::-1] for start, end in spans]
    ready = [(-len(p), doc) for doc, p in enumerate(pieces)]
    heapq.heapify(ready)
    waiting: list[tuple[int, int]] = []  # (stream position from which the document is ready, document)
    starts, lengths, position = [], [], 0
    while True:
        while waiting and waiting[0][0] <= position:
            doc = heapq.heappop(waiting)[1]
            heapq.heappush(ready, (-len(pieces[doc]), doc))
        if not ready:
            break
        doc = heapq.heappop(ready)[1]
        start, length = pieces[doc].pop()
        starts.append(start)
        lengths.append(length)
        position += length
        if pieces[doc]:
            heapq.heappush(waiting, (position + gap, doc))
    return np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)


class ApartPieces:
    """A split read as its documents' pieces in `apart_order`: the stream interface `PackedLoader` reads
    (`num_tokens`, `tokens`, `locate`), each piece a document that starts at its own stream position."""

    def __init__(self, split: TokenSplit, piece_len: int, gap: int):
        self.split = split
        self.sources, self.lengths = apart_order(document_spans(split), piece_len, gap)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.dropped_tokens = split.num_tokens - int(self.starts[-1])
        if len(self.lengths) == 0:
            raise ConfigError("data.piece_order=apart: the training split holds no document to cut")

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    def _runs(self, start: int, stop: int):
        """(piece index, offset within the piece, token count) covering new positions [start, stop)."""
        for k, a, b in covering_spans(self.starts, start, stop):
            yield k, a, b - a

    def tokens(self, start: int, stop: int) -> np.ndarray:
        parts = [self.split.tokens(int(self.sources[k]) + a, int(self.sources[k]) + a + n) for k, a, n in self._runs(start, stop)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def locate(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Each new position's document (its piece's first new position) and that document's first position."""
        firsts = [np.full(n, int(self.starts[k]), dtype=np.int64) for k, _, n in self._runs(start, stop)]
        first = np.concatenate(firsts) if firsts else np.zeros(0, dtype=np.int64)
        return first, first
