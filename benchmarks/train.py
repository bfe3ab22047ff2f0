"""Training-step throughput: ropelab Transformer vs Hugging Face LlamaForCausalLM of the same shape.

    python benchmarks/train.py                        # both shapes, fp32 and bf16 autocast
    python benchmarks/train.py --steps 8 --precisions fp32 --threads 1

One step = forward (with loss), backward, AdamW step, zero_grad. Both models hold the same weights
(`ropelab.sources.hf.to_hf`, sdpa attention), see the same batch and use the same optimizer:
`ropelab.train.optim.build_optimizer`, i.e. fused AdamW (HF's Trainer also defaults to fused AdamW,
"adamw_torch_fused", with torch >= 2.8). Their steps alternate, so both meet the same machine load.
`--compile` wraps both models in torch.compile (default: eager). Figures are tokens/s from the
median step time, and MFU: `Transformer.flops_per_token` (6N + attention) x tokens/s over the CPU's
measured matrix-product peak in the step's precision (`ropelab.train.throughput.peak_flops`).

Shapes:
  tiny-llama   the ropelab preset (4 layers, d_model 128, 2 heads, 1 kv head, head_dim 64, d_ff 384,
               tied embeddings) with vocab 4096
  llama-256    4 layers, d_model 256, 4 heads (head_dim 64), d_ff 704, vocab 4096
Batch 8 x 512 tokens for both in fp32. In bf16 autocast each library runs two ways: PyTorch's own bf16
kernels (`hf_llama`, `ropelab_native`), and `ropelab.precision.Bf16GemmInFp32`, which runs the linear
layers and attention as fp32 GEMMs on bf16-rounded operands (the same arithmetic: bf16 products are
exact in fp32, fp32 accumulation, bf16 results). `ropelab` is what `train.bf16_gemm=auto` picks on
this CPU; `hf_llama_fp32gemm` is HF's model under the same mode, to show what the mode alone gives.
PyTorch's bf16 kernels are far slower on CPUs without AVX512-BF16/AMX (oneDNN has no bf16 there:
torch.ops.mkldnn._is_mkldnn_bf16_supported() is False), so by default bf16 runs 2 x 512 tokens and
fewer steps (`--bf16-batch`, `--bf16-steps`) to keep the whole run to a few minutes on 2 cores;
every bf16 row shares that batch.
RoPE fraction 1.0 (HF Llama rotates every channel); `--fractions` adds ropelab-only fp32 runs at other
fractions (HF's Llama cannot rotate a fraction).
Prints a table, the ratios, then ONE JSON line with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from ropelab.config import MODEL_PRESETS, ModelConfig, RopeConfig, TrainConfig
from ropelab.sources.hf import to_hf
from ropelab.model import Transformer
from ropelab.precision import gemm_in_fp32, matmul_dtype, mixed_precision
from ropelab.train.optim import build_optimizer
from ropelab.train.throughput import peak_flops

VOCAB = 4096
SHAPES = {
    "tiny-llama": lambda: dataclasses.replace(MODEL_PRESETS["tiny-llama"], vocab_size=VOCAB, rope=RopeConfig(fraction=1.0)),
    "llama-256": lambda: ModelConfig(name="llama-256", vocab_size=VOCAB, n_layer=4, d_model=256, n_head=4, d_ff=704,
                                     max_seq_len=8192, rope=RopeConfig(fraction=1.0)),
}


# name -> (library, bf16_gemm policy used under bf16 autocast); fp32 runs the first of each library only.
VARIANTS = {"ropelab": ("ropelab", "auto"), "ropelab_native": ("ropelab", "native"),
            "hf_llama": ("hf", "native"), "hf_llama_fp32gemm": ("hf", "fp32")}


def make_steps(config: ModelConfig, batch: int, seq: int, precision: str, with_hf: bool, compile_models: bool):
    """Step functions (name -> (callable, bf16_gemm policy)) for one shape; the models share weights at the start."""
    torch.manual_seed(0)
    ours = Transformer(config).train()
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)
    inputs, targets = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    optim_config = TrainConfig(lr=1e-4)
    models = {"ropelab": (ours, lambda model: model(inputs, targets)[1])}
    if with_hf:  # HF shifts the labels itself
        models["hf"] = (to_hf(ours, attn_implementation="sdpa").train(), lambda model: model(input_ids=inputs, labels=inputs).loss)
    optimizers = {library: build_optimizer(model, optim_config) for library, (model, _) in models.items()}
    forwards = {library: torch.compile(model) if compile_models else model for library, (model, _) in models.items()}

    def step_of(library: str, gemm: str):
        loss_of, opt = models[library][1], optimizers[library]

        def step():
            with mixed_precision("cpu", precision == "bf16", gemm):
                loss = loss_of(forwards[library])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    variants = VARIANTS if precision == "bf16" else {"ropelab": VARIANTS["ropelab"], "hf_llama": VARIANTS["hf_llama"]}
    return {name: (step_of(library, gemm), gemm) for name, (library, gemm) in variants.items() if library in models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--precisions", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.25], help="extra ropelab-only fractions")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=7, help="timed fp32 steps per model (median)")
    parser.add_argument("--bf16-batch", type=int, default=2)
    parser.add_argument("--bf16-steps", type=int, default=3, help="timed bf16 steps per model (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per model (compile: at least 2)")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compile:
        args.warmup = max(args.warmup, 2)
    results = {}
    print(f"fp32: batch {args.batch} x {args.seq}, median of {args.steps} steps; bf16 autocast: batch "
          f"{args.bf16_batch} x {args.seq}, median of {args.bf16_steps} steps; {args.warmup} warm-up step(s); "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, fused AdamW (both), "
          f"{'torch.compile (both)' if args.compile else 'eager'}")
    # MFU against this CPU's measured matrix-product peak in the step's precision (same model FLOPs
    # for both libraries: the shapes are equal).
    peaks = {dtype: peak_flops("cpu", dtype) for dtype in (torch.float32, torch.bfloat16)}
    for dtype, (peak, source) in peaks.items():
        print(f"peak {dtype}: {peak / 1e9:.1f} GFLOP/s ({source})")
    print(f"train.bf16_gemm=auto on this CPU: {'fp32 GEMMs' if gemm_in_fp32('auto', 'cpu') else 'native bf16'}")
    print(f"{'shape':<11} {'precision':<9} {'model':<16} {'step s':>8} {'tokens/s':>10} {'MFU':>6}")
    for shape in args.shapes:
        flops_per_token = Transformer(SHAPES[shape]()).flops_per_token(args.seq)
        for precision in args.precisions:
            batch, n_steps = (args.bf16_batch, args.bf16_steps) if precision == "bf16" else (args.batch, args.steps)
            tokens = batch * args.seq
            steps = make_steps(SHAPES[shape](), batch, args.seq, precision, True, args.compile)
            for fraction in args.fractions if precision == "fp32" else []:
                config = dataclasses.replace(SHAPES[shape](), rope=RopeConfig(fraction=fraction))
                extra = make_steps(config, batch, args.seq, precision, False, args.compile)
                steps[f"ropelab@{fraction:g}"] = extra["ropelab"]
            gemms = {name: gemm for name, (_, gemm) in steps.items()}
            steps = {name: step for name, (step, _) in steps.items()}
            times = {name: [] for name in steps}
            for i in range(args.warmup + n_steps):
                names = list(steps)
                for name in names[i % len(names):] + names[: i % len(names)]:
                    t0 = time.perf_counter()
                    steps[name]()
                    elapsed = time.perf_counter() - t0
                    if i >= args.warmup:
                        times[name].append(elapsed)
            for name, ts in times.items():
                median = statistics.median(ts)
                peak = peaks[matmul_dtype("cpu", precision == "bf16", gemms[name])][0]
                mfu = flops_per_token * tokens / median / peak
                results[f"{shape}/{precision}/{name}"] = {"batch": batch, "step_s": round(median, 4),
                                                          "tokens_per_s": round(tokens / median, 1), "mfu": round(mfu, 4)}
                print(f"{shape:<11} {precision:<9} {name:<16} {median:8.3f} {tokens / median:10.0f} {mfu:6.1%}")
    ratios = {}
    for shape in args.shapes:
        for precision in args.precisions:
            ratios[f"{shape}/{precision}"] = ratio(results, shape, precision, "ropelab", "hf_llama")
        if "bf16" in args.precisions:
            ratios[f"{shape}/bf16/native_kernels"] = ratio(results, shape, "bf16", "ropelab_native", "hf_llama")
            ratios[f"{shape}/bf16/fp32_gemm"] = ratio(results, shape, "bf16", "ropelab", "hf_llama_fp32gemm")
        if "fp32" in args.precisions and "bf16" in args.precisions:
            for model in ("ropelab", "hf_llama"):
                ratios[f"{shape}/{model}/bf16_over_fp32"] = round(
                    results[f"{shape}/bf16/{model}"]["tokens_per_s"] / results[f"{shape}/fp32/{model}"]["tokens_per_s"], 4)
    print("ratios (tokens/s):")
    labels = {"native_kernels": "ropelab / HF, both PyTorch's bf16 kernels",
              "fp32_gemm": "ropelab / HF, both bf16 GEMMs in fp32", "bf16_over_fp32": "bf16 / fp32 tokens/s"}
    for key, value in ratios.items():
        label = labels.get(key.rsplit("/", 1)[-1], "ropelab (default) / HF (default)")
        target = "   target >= 1.2" if key.endswith("/bf16") else ""
        print(f"  {key:<34} {label:<44} {value:.2f}x{target}")
    print(json.dumps({"benchmark": "train", "seq": args.seq, "threads": torch.get_num_threads(), "compile": args.compile,
                      "optimizer": "fused AdamW (build_optimizer), both",
                      "peak_flops": {str(dtype).removeprefix("torch."): peak for dtype, (peak, _) in peaks.items()},
                      "bf16_gemm_auto": "fp32" if gemm_in_fp32("auto", "cpu") else "native",
                      "steps": {"fp32": args.steps, "bf16": args.bf16_steps}, "torch": torch.__version__,
                      "results": results, "ratios": ratios}))


def ratio(results: dict, shape: str, precision: str, ours: str, theirs: str) -> float:
    return round(results[f"{shape}/{precision}/{ours}"]["tokens_per_s"] / results[f"{shape}/{precision}/{theirs}"]["tokens_per_s"], 4)


if __name__ == "__main__":
    main()
