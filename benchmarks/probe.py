"""Probe cost: wall time and peak memory of one probe forward, three ways, side by side in one run.

    python benchmarks/probe.py                      # tiny-llama shape, 256 x 64 = 16k tokens, fp32, CPU
    python benchmarks/probe.py --preset llama-3.2-1b --block-len 2048 --repeats 64 --device cuda --dtype bf16

Methods, each in a fresh subprocess (peak memory is per process), in rotating order, --reps times:
  forward     the model's own forward over the window (`hidden_states`), nothing kept
  streaming   `ropelab.probe.capture.capture`: every stage of every layer, analysis rows only,
              streamed into a safetensors file (the probe's path)
  everything  hooks keeping every stage at every position, and the full logits (what streaming avoids)
Memory is the growth of the peak over the process after building the model (CPU: peak RSS; CUDA:
peak allocated). Weights are random: cost does not depend on them. Prints a table, the ratios
to `forward` (medians), then ONE JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ropelab.config import ModelConfig
from ropelab.model import Transformer
from ropelab.probe.capture import SafetensorsStream, capture
from ropelab.probe.config import STAGES, ProbeMode
from ropelab.probe.sequence import ProbeInput

METHODS = ("forward", "streaming", "everything")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _keep_everything(model: Transformer, ids: torch.Tensor) -> list:
    kept = []
    hooks = [model.embed.register_forward_hook(lambda m, i, o: kept.append(o.clone()))]
    for block in model.blocks:
        for module in (block.attn.q_norm, block.attn.k_norm, block):
            hooks.append(module.register_forward_hook(lambda m, i, o: kept.append(o.clone())))
    hooks += [rope.register_forward_hook(lambda m, i, o: kept.extend(x.clone() for x in o)) for rope in model.ropes]
    hooks.append(model.final_norm.register_forward_hook(lambda m, i, o: kept.append(o.clone())))
    try:
        kept.append(model(ids)[0].float())
    finally:
        for hook in hooks:
            hook.remove()
    return kept


def worker(args) -> None:
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = ModelConfig.from_name(args.preset, vocab_size=args.vocab)
    model = Transformer(config).to(device=device, dtype=DTYPES[args.dtype]).eval()
    content = torch.randint(0, 256, (args.block_len - 2,)).tolist()
    probe = ProbeInput(content, args.repeats, 257, 256, "", "random")
    ids = probe.input_ids().to(device).unsqueeze(0)
    model.hidden_states(ids[:, : args.block_len])  # warm-up: kernels, RoPE table of one block
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = _peak(device)
    start = time.perf_counter()
    with torch.inference_mode():
        if args.worker == "forward":
            model.hidden_states(ids)
        elif args.worker == "streaming":
            with tempfile.TemporaryDirectory() as tmp, SafetensorsStream(Path(tmp) / "c.safetensors") as stream:
                capture(model, probe, ProbeMode(), tuple(range(config.n_layer)), STAGES, stream)
                stream.finish()
        else:
            _keep_everything(model, ids)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_growth_bytes": _peak(device) - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-llama")
    parser.add_argument("--vocab", type=int, default=320, help="vocabulary size (default 320: bytes, padded)")
    parser.add_argument("--block-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    figures: dict[str, list[dict]] = {m: [] for m in METHODS}
    passthrough = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in ("preset", "vocab", "block_len", "repeats", "dtype", "device")]
    for rep in range(args.reps):
        for method in METHODS[rep % 3:] + METHODS[: rep % 3]:
            out = subprocess.run([sys.executable, __file__, *passthrough, "--worker", method],
                                 capture_output=True, text=True, check=True)
            figures[method].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {m: {k: statistics.median(r[k] for r in rows) for k in ("seconds", "peak_growth_bytes")}
               for m, rows in figures.items()}
    window = args.block_len * args.repeats
    print(f"{args.preset}, {window:,} tokens ({args.repeats} x {args.block_len}), {args.dtype}, {args.device}; "
          f"medians of {args.reps}")
    print(f"{'method':<12}{'seconds':>10}{'peak growth MiB':>18}{'time / forward':>16}{'memory / forward':>18}")
    base = medians["forward"]
    for method, m in medians.items():
        print(f"{method:<12}{m['seconds']:>10.2f}{m['peak_growth_bytes'] / 2**20:>18.1f}"
              f"{m['seconds'] / base['seconds']:>16.2f}{m['peak_growth_bytes'] / max(base['peak_growth_bytes'], 1):>18.2f}")
    print(json.dumps({"benchmark": "probe", "preset": args.preset, "window": window, "dtype": args.dtype,
                      "device": args.device, "reps": args.reps, "medians": medians,
                      "time_ratio": {m: medians[m]["seconds"] / base["seconds"] for m in METHODS},
                      "memory_ratio": {m: medians[m]["peak_growth_bytes"] / max(base["peak_growth_bytes"], 1) for m in METHODS}}))


if __name__ == "__main__":
    main()
