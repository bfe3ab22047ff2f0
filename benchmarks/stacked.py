"""Stacked members (`ropelab train-stacked`) against the same runs trained one after another, eagerly.

    python benchmarks/stacked.py                                  # 10 members, micro-batch 1 and 8, 40 steps
    python benchmarks/stacked.py --micro-batches 2 --steps 60 --threads 2
    python benchmarks/stacked.py --shape 64 192 3                 # the largest size

The members are the smallest shape of configs/claims/partial-scaling.yaml (d_model 32, d_ff 64, one head
of 64, one layer, bytes, 256 per window, fp32; `--shape` sets d_model, d_ff and layers): NoPE, two
channels, 10 %, 25 % and full RoPE, seeds 0 and 1 (ten runs; `--members` takes the first N of them). For
each micro-batch the stack trains once (`ropelab.train.stacked_loop.train_stacked`) and each member once
alone (`ropelab.train.loop.train`), no evaluation or checkpoint until the end. A step's time is the
median over the steps after `--warmup`; the stack's time per member is its step time over N. Prints a
table, then ONE JSON line of every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from ropelab.config import build_run_config
from ropelab.machine import cpu_kind
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics
from ropelab.train.stacked_loop import train_stacked

SHAPE = ["model.n_head=1", "model.n_kv_head=1", "model.head_dim=64", "data.corpus=stdlib", "data.tokenizer=bytes",
         "train.precision=fp32", "train.progress=false", "train.tensorboard=false"]
MEMBERS = [[variant, f"seed={seed}"] for seed in (0, 1) for variant in (
    "model.rope.fraction=0.0", "model.rope.rotary_dims=2", "model.rope.fraction=0.1", "model.rope.fraction=0.25",
    "model.rope.fraction=1.0")]


def step_seconds(run_dir: Path, warmup: int) -> float:
    """The median wall time of a run's steps after the first `warmup` (tokens per step / tokens_per_s)."""
    rows = [r for r in read_metrics(run_dir) if "tokens_per_s" in r][warmup:]
    return statistics.median(r["tokens"] / r["step"] / r["tokens_per_s"] for r in rows)


def measure(micro_batch: int, members: int, steps: int, seq_len: int, warmup: int, shape: list[int]) -> dict:
    d_model, d_ff, layers = shape
    overrides = [*SHAPE, f"model.d_model={d_model}", f"model.d_ff={d_ff}", f"model.n_layer={layers}",
                 f"data.seq_len={seq_len}", f"train.micro_batch={micro_batch}", f"train.steps={steps}",
                 f"train.eval_every={steps}", f"train.checkpoint_every={steps}", "train.eval_batches=1"]
    runs = [overrides + member for member in MEMBERS[:members]]
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        train_stacked([build_run_config(overrides=run) for run in runs], [root / f"stacked{i}" for i in range(members)])
        stacked = step_seconds(root / "stacked0", warmup)
        eager = []
        for index, run in enumerate(runs):
            train(build_run_config(overrides=run), root / f"eager{index}")
            eager.append(step_seconds(root / f"eager{index}", warmup))
    tokens = micro_batch * seq_len
    eager_mean = statistics.mean(eager)
    return {"micro_batch": micro_batch, "members": members, "stacked_step_ms": 1e3 * stacked,
            "stacked_ms_per_member": 1e3 * stacked / members, "eager_step_ms": 1e3 * eager_mean,
            "stacked_tokens_per_s": tokens * members / stacked, "eager_tokens_per_s": tokens / eager_mean,
            "speedup": eager_mean * members / stacked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--members", type=int, default=len(MEMBERS), choices=range(1, len(MEMBERS) + 1))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--shape", type=int, nargs=3, default=[32, 64, 1], metavar=("D_MODEL", "D_FF", "LAYERS"))
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    torch.set_num_threads(args.threads)
    results = [measure(mb, args.members, args.steps, args.seq, args.warmup, args.shape) for mb in args.micro_batches]
    print(f"{'micro-batch':>11} {'members':>7} {'stacked ms/step':>15} {'per member':>10} {'eager ms/step':>13} "
          f"{'stacked tok/s':>13} {'eager tok/s':>11} {'speed-up':>8}")
    for r in results:
        print(f"{r['micro_batch']:>11} {r['members']:>7} {r['stacked_step_ms']:>15.1f} {r['stacked_ms_per_member']:>10.2f} "
              f"{r['eager_step_ms']:>13.2f} {r['stacked_tokens_per_s']:>13,.0f} {r['eager_tokens_per_s']:>11,.0f} "
              f"{r['speedup']:>7.2f}x")
    print(json.dumps({"cpu": cpu_kind(), "threads": args.threads, "seq_len": args.seq, "shape": args.shape,
                      "results": results}))


if __name__ == "__main__":
    main()
