"""`ropelab study --dry-run`: what a study would cost, without training anything.

FLOPs use PaLM's per-token formula (`Transformer.flops_per_token`). Memory per GPU for
data parallelism counts fp32 weights, fp32 gradients and two fp32 Adam moments (16 bytes
per parameter; with FSDP that is divided by the number of GPUs) plus activations of one
micro-batch in bf16 after Korthikanti et al. (2022), ``seq * batch * d_model * 34`` bytes per
layer with a fused attention kernel (no ``T x T`` score matrix kept).
"""

from __future__ import annotations

import dataclasses

from ropelab.config import RunConfig
from ropelab.model import Transformer
from ropelab.sources.plans import shape_config
from ropelab.study.grid import PlannedRun
from ropelab.train.phases import base_warnings, resolve_phases

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, NVIDIA H100 SXM datasheet (H200 has the same compute)


def run_plan(run: PlannedRun, mfu: float = 0.4, peak_flops: float = H100_BF16_PEAK) -> dict:
    import torch

    config: RunConfig = run.config
    model_config = dataclasses.replace(shape_config(config.model), vocab_size=config.model.vocab_size or 4096)
    with torch.device("meta"):
        model = Transformer(model_config)
    params = model.num_params()
    phases = resolve_phases(config, config.train.data_parallel or 1)
    tokens = flops = activations = 0
    for phase in phases:  # phases may differ in length and batch
        tc, seq = phase.config.train, phase.config.data.seq_len
        phase_tokens = phase.steps * tc.global_batch * seq
        tokens += phase_tokens
        flops += model.flops_per_token(seq) * phase_tokens
        activations = max(activations, seq * tc.micro_batch * model_config.d_model * 34 * model_config.n_layer)
    return {
        "run": run.id,
        "steps": phases[-1].end,
        "tokens": tokens,
        "params": params,
        "flops": flops,
        "gpu_hours": flops / (mfu * peak_flops) / 3600,
        "memory_per_gpu_gb": (16 * params + activations) / 1e9,
        "warnings": base_warnings(phases),
    }


def print_plan(runs: list[PlannedRun], mfu: float = 0.4) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    rows = [run_plan(r, mfu) for r in runs]
    table = Table(title=f"study plan ({len(rows)} runs; GPU-hours at {mfu:.0%} MFU of an H100's {H100_BF16_PEAK / 1e12:.0f} TFLOP/s bf16)")
    for col in ("run", "steps", "tokens", "params", "FLOPs", "GPU-hours", "memory/GPU (DDP, no act. ckpt)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["run"], f"{r['steps']:,}", f"{r['tokens']:.3g}", f"{r['params'] / 1e6:,.1f}M", f"{r['flops']:.3g}",
                      f"{r['gpu_hours']:,.1f}", f"{r['memory_per_gpu_gb']:.1f} GB")
    total = sum(r["gpu_hours"] for r in rows)
    table.add_row("total", "", f"{sum(r['tokens'] for r in rows):.3g}", "", f"{sum(r['flops'] for r in rows):.3g}", f"{total:,.1f}", "")
    Console().print(table)
    for r in rows:
        for line in r["warnings"]:
            print(f"{r['run']}: {line}")
    return rows
