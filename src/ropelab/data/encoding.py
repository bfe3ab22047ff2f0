"""Documents to token ids in worker processes, in order (`ropelab.data.prepare`'s encoding).

The main process reads documents and hands batches of them to worker processes, which tokenize
them (EOS appended, BOS prepended on request) and decide their split; results come back in
submission order, so the output does not depend on the number of workers. Workers ignore SIGINT
and die quietly on SIGTERM: the main process handles both and ends the workers.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
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


def _work(encoder: Encoder, tasks, results) -> None:
    """A worker: batches from `tasks`, ("ok", encoded) or ("error", exception) to `results`, until None.
    A thread takes the batches in as they come, so that the main process's sends never wait on this
    worker while it is busy sending a result the main process has not asked for yet."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process handles Ctrl-C and ends the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # how the main process ends them at once
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked since the fork, see encoded_batches
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def take_in() -> None:
        while True:
            batch = tasks.recv()
            inbox.put(batch)
            if batch is None:
                return

    threading.Thread(target=take_in, daemon=True).start()
    while (batch := inbox.get()) is not None:
        try:
            results.send(("ok", encoder(batch)))
        except Exception as error:  # handed to the main process, which raises it
            results.send(("error", error))


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
    """Encoded batches in input order; with workers > 1, batch i goes to worker i mod workers and at most 2 per
    worker are in flight.

    Each worker has a pipe of its own each way, and no lock is shared between processes. With
    multiprocessing.Pool, a Ctrl-C could hang the process for good: its terminate() ends the thread that
    reads results before it ends the workers, and a worker still sending a large result then holds the
    results queue's lock, on which terminate() waits (seen in one of three test-suite runs). Here an
    interrupted run simply ends its workers (SIGTERM) and waits for them."""
    if workers <= 1:
        yield from map(encoder, batches)
        return
    # fork where the platform has it: spawn would re-run a user's unguarded script in every worker
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    # a tokenizer that already used its thread pool warns in every forked child unless this is set
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    links = []  # (process, its task pipe's sending end, its result pipe's receiving end)
    finished = False
    try:
        # Workers begin with SIGINT and SIGTERM blocked until `_work` has reset them: a worker inherits this
        # process's Python handlers, and a SIGTERM ending it at once would trip one, be dropped when the
        # handler is reset, and leave a live worker that this process waits for forever.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            for _ in range(workers):
                task_out, task_in = context.Pipe(duplex=False)
                result_out, result_in = context.Pipe(duplex=False)
                process = context.Process(target=_work, args=(encoder, task_out, result_in), daemon=True)
                process.start()
                task_out.close()
                result_in.close()
                links.append((process, task_in, result_out))
        finally:  # a worker that failed to start leaves the ones before it to the outer finally
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if previous is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = previous
        in_flight: deque = deque()  # the worker of each batch sent, oldest first
        for index, batch in enumerate(batches):
            worker = index % workers
            links[worker][1].send(batch)
            in_flight.append(worker)
            if len(in_flight) >= 2 * workers:
                yield _result(links[in_flight.popleft()])
        while in_flight:
            yield _result(links[in_flight.popleft()])
        for _, tasks, _ in links:
            tasks.send(None)
        finished = True
    finally:
        for process, tasks, results in links:
            if not finished:
                process.terminate()
            process.join()
            tasks.close()
            results.close()


def _result(link) -> list:
    process, _, results = link
    try:
        status, payload = results.recv()
    except EOFError:
        raise RuntimeError(f"data prepare: worker process {process.pid} ended without its batch "
                           f"(exit code {process.exitcode})") from None
    if status == "error":
        raise payload
    return payload
