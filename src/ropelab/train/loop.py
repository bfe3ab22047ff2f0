"""The training loop: one process, gradient accumulation, bf16 autocast, periodic validation,
crash-safe checkpoints and exact resume.

A run directory holds:
  config.yaml      the resolved configuration (what --resume uses)
  metrics.jsonl    one JSON row per step; validation rows carry "val_loss"
  checkpoints/     see `ropelab.train.checkpoint`
  result.json      written when the run finishes ("status": "done")
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import yaml

from ropelab.config import ConfigError, RunConfig, build_run_config
from ropelab.data.loader import PackedLoader
from ropelab.data.pipeline import build_loaders
from ropelab.data.tokenizer import padded_vocab
from ropelab.model import Transformer, model_summary
from ropelab.train import checkpoint as ckpt
from ropelab.train.optim import build_optimizer, lr_at, set_lr

Callback = Callable[[dict], None]


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_train_loss: float
    final_val_loss: float
    tokens: int
    wall_time_s: float
    tokens_per_s: float

    def to_dict(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r}: CUDA is not available on this machine")
    return torch.device(name)


def autocast(config: RunConfig, device: torch.device):
    precision = config.train.precision
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate_loss(model: Transformer, loader: PackedLoader, config: RunConfig, device: torch.device) -> float:
    model.eval()
    total, count = 0.0, 0
    use_doc_ids = config.attention.doc_mask
    for batch in loader.sequential(config.train.eval_batches * config.train.micro_batch, config.train.micro_batch):
        batch = batch.to(device)
        with autocast(config, device):
            _, loss = model(batch.input_ids, batch.labels, batch.position_ids, batch.doc_ids if use_doc_ids else None)
        n = batch.input_ids.shape[0]
        total += loss.item() * n
        count += n
    model.train()
    return total / count


class MetricsLog:
    """Append-only metrics.jsonl; on resume, rows after the checkpoint's step are dropped."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = path
        if resume_step and path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            kept = [r for r in rows if r["step"] <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.file = open(path, "a")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml; not a ropelab run directory")
    return build_run_config(yaml.safe_load(path.read_text()))


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(), disable=not enabled, transient=False,
    )


def train(
    config: Optional[RunConfig] = None,
    out_dir: str | Path = "runs/default",
    resume: bool = False,
    callbacks: tuple[Callback, ...] = (),
) -> TrainResult:
    """Train (or resume) one run in `out_dir`. Returns the final figures."""
    run_dir = Path(out_dir)
    config_path = run_dir / "config.yaml"
    start_step, state = 0, None
    if resume:
        config = load_run_config(run_dir)
        latest = ckpt.latest_checkpoint(run_dir)
        if (run_dir / "result.json").is_file():
            result = json.loads((run_dir / "result.json").read_text())
            print(f"{run_dir}: run already finished at step {result['steps']}; nothing to do")
            return TrainResult(**{**result, "run_dir": run_dir})
        if latest is None:
            raise ConfigError(f"{run_dir}: no complete checkpoint to resume from")
    else:
        config = (config or RunConfig()).validate()
        if config_path.exists() or (run_dir / "metrics.jsonl").exists():
            raise ConfigError(f"{run_dir}: already holds a run; pass --resume to continue it or choose another --out")

    if config.train.data_parallel != 1:
        raise ConfigError(
            f"train.data_parallel={config.train.data_parallel}: this trainer runs one process; "
            "set train.data_parallel=1 and raise train.grad_accum to keep the global batch"
        )
    device = resolve_device(config.train.device)
    loader, val_loader, manifest = build_loaders(config)
    if config.model.vocab_size is None:
        config.model.vocab_size = padded_vocab(manifest["vocab_size"])
    elif config.model.vocab_size < manifest["vocab_size"]:
        raise ConfigError(
            f"model.vocab_size={config.model.vocab_size}: smaller than the tokenizer's {manifest['vocab_size']}"
        )
    if not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(config.to_yaml())

    torch.manual_seed(config.seed)
    model = Transformer(config.model).to(device)
    model.set_attention_backend(config.attention.backend)
    optimizer = build_optimizer(model, config.train)
    if resume:
        state = ckpt.load_checkpoint(latest, model, optimizer)
        start_step = state["step"]
    forward = torch.compile(model) if config.train.compile else model

    tc = config.train
    tokens_per_step = tc.global_batch * config.data.seq_len
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=start_step)
    summary = model_summary(model)
    last_loss, last_val = float("nan"), float("nan")
    wall_start = time.perf_counter()
    compute_time = 0.0
    step = start_step
    use_doc_ids = config.attention.doc_mask

    def save(at_step: int) -> None:
        ckpt.save_checkpoint(run_dir, at_step, model, optimizer, {"data": {"seed": config.seed, "next_step": at_step}}, tc.keep_checkpoints)

    progress = _progress(tc.progress)
    try:
        with progress:
            task = progress.add_task("train", total=tc.steps, completed=start_step, status=
                                     f"{summary['params'] / 1e6:.1f}M params, rotary {summary['rotary_dims']}/{summary['head_dim']}")
            while step < tc.steps:
                t0 = time.perf_counter()
                lr = lr_at(step, tc)
                set_lr(optimizer, lr)
                loss_sum = 0.0
                for micro in range(tc.grad_accum):
                    batch = loader.batch(step, micro, tc.micro_batch, tc.grad_accum).to(device)
                    with autocast(config, device):
                        _, loss = forward(batch.input_ids, batch.labels, batch.position_ids, batch.doc_ids if use_doc_ids else None)
                    (loss / tc.grad_accum).backward()
                    loss_sum += loss.item()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip).item()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                dt = time.perf_counter() - t0
                compute_time += dt
                last_loss = loss_sum / tc.grad_accum
                row = {"step": step, "tokens": step * tokens_per_step, "loss": last_loss, "lr": lr,
                       "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt}
                if step % tc.eval_every == 0 or step == tc.steps:
                    last_val = evaluate_loss(model, val_loader, config, device)
                    row["val_loss"] = last_val
                if step % tc.log_every == 0 or "val_loss" in row:
                    metrics.write(row)
                for callback in callbacks:
                    callback(row)
                if step % tc.checkpoint_every == 0 or step == tc.steps:
                    save(step)
                val_text = f" val {last_val:.3f}" if last_val == last_val else ""
                progress.update(task, completed=step, status=f"loss {last_loss:.3f}{val_text} {row['tokens_per_s']:,.0f} tok/s")
    except KeyboardInterrupt:
        if step > start_step and ckpt.latest_checkpoint(run_dir) != ckpt.checkpoint_dir(run_dir) / f"step_{step:08d}":
            save(step)
        raise
    finally:
        metrics.close()

    trained_steps = step - start_step
    result = TrainResult(
        run_dir=run_dir,
        steps=step,
        final_train_loss=last_loss,
        final_val_loss=last_val,
        tokens=step * tokens_per_step,
        wall_time_s=time.perf_counter() - wall_start,
        tokens_per_s=trained_steps * tokens_per_step / compute_time if compute_time else float("nan"),
    )
    (run_dir / "result.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result
