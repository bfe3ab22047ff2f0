"""Documents to token ids in worker processes, in order (`ropelab.data.prepare`'s encoding).

The main process reads documents and hands batches of them to a pool of workers, which tokenize
them (EOS appended, BOS prepended on request) and decide their split; results come back in
submission order, so the output does not depend on the number of workers. Workers ignore SIGINT
and die quietly on SIGTERM: the main process handles both and ends the pool.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

from ropelab.config import ConfigError
from ropelab.data.corpus import in_validation
from ropelab.data.tokenizer import Tokenizer
from ropelab.data.tokens import token_dtype

BATCH_CHARS = 1 << 18
BATCH_DOCUMENTS = 1024
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass
class Encoder:
    """Turns a batch of (key, text) into (token ids, in validation) or None for an empty document."""

    tokenizer: Tokenizer
    val_percent: float
    bos: bool
    encoding_errors: str

    def __call__(self, batch: list[tuple[Optional[str], Optional[str]]]) -> list[Optional[tuple[np.ndarray, bool]]]:
        kept = [(key, text) for key, text in batch if text and text.strip()]
        texts = [text for _, text in kept]
        try:
            encoded = iter(self.tokenizer.encode_batch(texts))
        except UnicodeEncodeError:  # lone surrogates, e.g. from JSON "\ud800" escapes
            if self.encoding_errors == "strict":
                raise ConfigError("a document holds invalid Unicode (lone surrogates); pass --encoding-errors replace") from None
            texts = [t.encode("utf-8", "replace").decode("utf-8") for t in texts]
            encoded = iter(self.tokenizer.encode_batch(texts))
        dtype = token_dtype(self.tokenizer.vocab_size)
        head = int(self.bos)
        out = []
        for key, text in batch:
            if not (text and text.strip()):
                out.append(None)
                continue
            body = next(encoded)
            ids = np.empty(head + len(body) + 1, dtype=dtype)
            ids[head:-1] = body
            ids[-1] = self.tokenizer.eos_id
            if head:
                ids[0] = self.tokenizer.bos_id
            out.append((ids, in_validation(text if key is None else key, self.val_percent)))
        return out


_worker_encoder: Optional[Encoder] = None


def _init_worker(encoder: Encoder) -> None:
    global _worker_encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and ends the pool
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # how the pool ends its workers
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked since the fork, see encoded_batches
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_encoder = encoder


def _encode_in_worker(batch):
    return _worker_encoder(batch)


def batches_of(documents: Iterator, chars: int = BATCH_CHARS, most: int = BATCH_DOCUMENTS) -> Iterator[list]:
    """Batches of about `chars` characters (at most `most` documents), so workers get even shares."""
    batch, size = [], 0
    for item in documents:
        batch.append(item)
        size += len(item[1] or "")
        if size >= chars or len(batch) == most:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encoded_batches(encoder: Encoder, batches: Iterator[list], workers: int) -> Iterator[list]:
    """Encoded batches in input order; with workers > 1 at most 2 per worker are in flight."""
    if workers <= 1:
        yield from map(encoder, batches)
        return
    # fork where the platform has it: spawn would re-run a user's unguarded script in every worker
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # a tokenizer that already used its thread pool warns in every forked child unless this is set
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Workers (and the pool's threads, which start replacements) begin with SIGINT and SIGTERM blocked,
    # until `_init_worker` has reset them: a worker inherits this process's Python handlers, and a
    # SIGTERM from a pool ended at once would trip one, be dropped when the handler is reset, and
    # leave a live worker that the pool waits for forever.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        pool = multiprocessing.get_context(method).Pool(workers, _init_worker, (encoder,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous
    with pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
