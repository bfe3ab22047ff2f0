"""Tokenization throughput of `ropelab data prepare` against a plain single-process encode loop.

    python benchmarks/data.py                     # trained BPE bpe:4096 on the built-in stdlib corpus
    python benchmarks/data.py --tokenizer bpe:8192 --workers 1 2 4

Methods (timed in rotating order, median of --reps; tokens/s counts every token produced):
  encode_loop   `tokenizers.Tokenizer.encode(text)` per document in one process, over documents
                already in memory (reading the files is not timed)
  prepare_wN    `ropelab.data.prepare.prepare` end to end with N worker processes: reading the
                files, split hashing, batched tokenization, EOS, writing and checksumming shards
Also reported: CPU seconds (this process and its finished workers), which show how much of the
machine a method used: on a shared machine, wall-clock gains from workers need idle cores.
Prints a table and the ratio of each prepare run to the loop, then ONE JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ropelab.data.corpus import stdlib_entries
from ropelab.data.prepare import prepare
from ropelab.data.sources import Source
from ropelab.data.tokenizer import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="bpe:4096")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)  # trained and cached before any timing
    docs = [text for text in (path.read_text(encoding="utf-8", errors="replace") for _, path in stdlib_entries()) if text.strip()]
    scratch = Path(tempfile.mkdtemp(prefix="ropelab-bench-"))

    def encode_loop() -> int:
        return sum(len(tokenizer.tok.encode(text, add_special_tokens=False).ids) for text in docs)

    def prepare_with(workers: int):
        def run() -> int:
            out = scratch / f"w{workers}"
            shutil.rmtree(out, ignore_errors=True)
            manifest = prepare(Source("stdlib"), tokenizer, out, workers=workers, progress=False)
            return sum(info["tokens"] for info in manifest["splits"].values())
        return run

    methods = {"encode_loop": encode_loop} | {f"prepare_w{w}": prepare_with(w) for w in args.workers}
    times: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    tokens: dict[str, int] = {}

    def cpu_seconds() -> float:
        return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    try:
        for name, run in methods.items():  # warm-up (page cache, tokenizer caches)
            run()
        for _ in range(args.reps):
            for name, run in methods.items():
                start, start_cpu = time.perf_counter(), cpu_seconds()
                tokens[name] = run()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(cpu_seconds() - start_cpu)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rate = {name: tokens[name] / statistics.median(t) for name, t in times.items()}

    print(f"{len(docs)} stdlib documents, tokenizer {args.tokenizer} ({tokenizer.vocab_size} tokens), {os.cpu_count()} CPUs")
    print(f"{'method':<13} {'tokens':>11} {'median s':>9} {'cpu s':>7} {'tokens/s':>12} {'vs loop':>8}")
    for name in methods:
        print(f"{name:<13} {tokens[name]:>11,} {statistics.median(times[name]):>9.2f} {statistics.median(cpu[name]):>7.2f} "
              f"{rate[name]:>12,.0f} {rate[name] / rate['encode_loop']:>7.2f}x")
    print(json.dumps({
        "benchmark": "data_prepare_tokenization", "tokenizer": args.tokenizer, "documents": len(docs),
        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "tokens": tokens, "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
        "median_cpu_s": {k: round(statistics.median(v), 3) for k, v in cpu.items()},
        "tokens_per_s": {k: round(v) for k, v in rate.items()},
        "ratio_vs_loop": {k: round(v / rate["encode_loop"], 3) for k, v in rate.items()},
    }))


if __name__ == "__main__":
    main()
