"""Training tokens/s of the claims' tiny frontier shapes at one thread, settings side by side.

    python benchmarks/tiny_shapes.py                       # micro-batch 8 and 16, and 4 x 2 accumulation
    python benchmarks/tiny_shapes.py --rounds 3 --steps 120 --settings "train.micro_batch=8" "train.compile=true"

Each setting trains `ropelab.train.loop.train` in a fresh temporary folder on the 2-layer shape of
configs/claims/partial-scaling.yaml (d_model 64, one head of 64, d_ff 192, bytes, 256 per window, fp32,
one thread, no evaluation or checkpoint until the end), and reports the median tokens/s of its steps
after the first 20 (compilation and warm-up left out; the wall time keeps them). Settings alternate
within a round, so every round's figures meet the same machine load: compare within a round.
Prints a table, then ONE JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from ropelab.config import build_run_config
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics

SHAPE = ["model.n_layer=2", "model.d_model=64", "model.n_head=1", "model.n_kv_head=1", "model.d_ff=192",
         "data.corpus=stdlib", "data.tokenizer=bytes", "data.seq_len=256", "train.precision=fp32",
         "train.progress=false", "train.tensorboard=false"]
DEFAULT_SETTINGS = ["train.micro_batch=8", "train.micro_batch=16", "train.micro_batch=4 train.grad_accum=2"]


def measure(setting: str, steps: int) -> dict:
    overrides = [*SHAPE, f"train.steps={steps}", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
                 *setting.split()]
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        train(build_run_config({"preset": "tiny-llama"}, overrides=overrides), f"{folder}/run")
        wall = time.perf_counter() - start
        rows = read_metrics(f"{folder}/run")
    return {"setting": setting, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[20:]), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, help="dotted overrides, one string per setting")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.steps <= 20:
        parser.error("--steps must exceed the 20 warm-up steps left out")
    torch.set_num_threads(1)
    results = [[measure(setting, args.steps) for setting in args.settings] for _ in range(args.rounds)]
    for index, round_results in enumerate(results, 1):
        for r in round_results:
            print(f"round {index}  {r['setting']:<45} {r['tokens_per_s']:>9,.0f} tokens/s  {r['wall_s']:6.1f} s")
    print(json.dumps({"rounds": results}))


if __name__ == "__main__":
    main()
