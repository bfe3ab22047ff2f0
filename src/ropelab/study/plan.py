"""`ropelab study --dry-run`: what a study would cost, without training anything.

FLOPs use PaLM's per-token formula (`Transformer.flops_per_token`). Memory per GPU for
data parallelism counts fp32 weights, fp32 gradients and two fp32 Adam moments (16 bytes
per parameter; with FSDP that is divided by the number of GPUs) plus activations of one
micro-batch in bf16 after Korthikanti et al. (2022), ``seq * batch * d_model * 34`` bytes per
layer with a fused attention kernel (no ``T x T`` score matrix kept).

`phase_counts` is the one count of a run's steps and tokens, phase by phase; `ropelab claims
--dry-run` prices its runs from it too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ropelab.config import RunConfig
from ropelab.model import Transformer
from ropelab.sources.plans import shape_config
from ropelab.study.grid import PlannedRun
from ropelab.train.phases import Phase, base_warnings, resolve_phases

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, NVIDIA H100 SXM datasheet (H200 has the same compute)


@dataclass(frozen=True)
class PhaseCount:
    """One phase of a run: the steps and tokens it spans, and of those the ones the run trains itself
    (`trained_steps`: a branch of another run starts at its parent's step)."""

    phase: Phase
    trained_steps: int

    @property
    def tokens_per_step(self) -> int:
        return self.phase.config.train.global_batch * self.phase.config.data.seq_len

    @property
    def tokens(self) -> int:
        return self.phase.steps * self.tokens_per_step

    @property
    def trained_tokens(self) -> int:
        return self.trained_steps * self.tokens_per_step


def phase_counts(config: RunConfig) -> list[PhaseCount]:
    """The run's phases at its data-parallel width, each with the steps the run trains itself: all of
    them, but for a branch (`train.branch_from`) only those from `train.branch_step` on."""
    start = (config.train.branch_step or 0) if config.train.branch_from else 0
    return [PhaseCount(phase, max(0, phase.end - max(phase.start, start)))
            for phase in resolve_phases(config, config.train.data_parallel or 1)]


def run_plan(run: PlannedRun, mfu: float = 0.4, peak_flops: float = H100_BF16_PEAK) -> dict:
    import torch

    config: RunConfig = run.config
    model_config = replace(shape_config(config.model), vocab_size=config.model.vocab_size or 4096)
    with torch.device("meta"):
        model = Transformer(model_config)
    params = model.num_params()
    counts = phase_counts(config)
    tokens = flops = activations = 0
    for count in counts:  # phases may differ in length and batch
        tc, seq = count.phase.config.train, count.phase.config.data.seq_len
        tokens += count.tokens
        flops += model.flops_per_token(seq) * count.tokens
        activations = max(activations, seq * tc.micro_batch * model_config.d_model * 34 * model_config.n_layer)
    return {
        "run": run.id,
        "steps": counts[-1].phase.end,
        "tokens": tokens,
        "params": params,
        "flops": flops,
        "gpu_hours": flops / (mfu * peak_flops) / 3600,
        "memory_per_gpu_gb": (16 * params + activations) / 1e9,
        "warnings": base_warnings([count.phase for count in counts]),
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
