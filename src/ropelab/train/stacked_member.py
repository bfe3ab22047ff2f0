"""One member of a stack (`ropelab.train.stacked_loop`): its run folder kept as a separate eager
`ropelab train` keeps it (`ropelab.train.loop`): config.yaml, metrics.jsonl rows of the same keys,
checksummed checkpoints with the same `extra`, result.json, and its own lock, data, schedule, optimizer
and skip guard.

Its `model` is a plain `Transformer` whose parameters the stack turns into views of the stacked
weights (`ropelab.train.stacked_model`); its optimizer is the `torch.optim.AdamW` the eager trainer
builds over it, so each step is the eager step's arithmetic. A checkpoint is written from a copy of the
member's weights and of its optimizer state (`materialise`), so that it holds this member alone and
`ropelab train --resume` continues the member on its own.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ropelab.config import RunConfig
from ropelab.data.pipeline import build_loaders, fit_vocab_size
from ropelab.errors import TrainingDiverged
from ropelab.model import Transformer
from ropelab.precision import matmul_dtype
from ropelab.sources.runs import CONFIG, write_result
from ropelab.train import checkpoint as ckpt
from ropelab.train.distributed import DistEnv, clip_grad_norm
from ropelab.train.loop import TrainResult, data_passes
from ropelab.train.lock import RunLock
from ropelab.train.metrics import MetricsLog
from ropelab.train.optim import allocate_state, build_optimizer, lr_at, set_lr
from ropelab.train.phases import base_warnings, resolve_phases, tokens_seen
from ropelab.train.skip_guard import SkipGuard
from ropelab.train.throughput import Throughput
from ropelab.train.validation import evaluate_loss

ERROR_FILE = "error.txt"  # a diverged member's one line, as a study's runner reads failed runs


def materialise(model: Transformer, optimizer: torch.optim.AdamW, config: RunConfig
                ) -> tuple[Transformer, torch.optim.AdamW]:
    """A plain copy of a member's model (weights in their own storage, not views of a stack) and an
    AdamW over it holding a copy of the member's optimizer state: what a checkpoint of the member holds."""
    plain = Transformer(config.model, init=False).to(next(model.parameters()).device)
    plain.load_state_dict(model.state_dict())
    plain.set_rope(config.model)
    plain_optimizer = build_optimizer(plain, config.train)
    plain_optimizer.load_state_dict(optimizer.state_dict())
    return plain, plain_optimizer


class Member:
    """A member's run: its folder (made here, with config.yaml, under `lock`, which it releases on `close`),
    loaders, model, optimizer and bookkeeping."""

    def __init__(self, config: RunConfig, run_dir: Path, device: torch.device, env: DistEnv, lock: RunLock):
        self.run_dir, self.device, self.env, self.lock = run_dir, device, env, lock
        self.phase = resolve_phases(config)[0]
        config.train.steps = self.phase.end
        self.config, pc = config, self.phase.config
        for line in base_warnings([self.phase]):
            print(line, file=sys.stderr)
        self.loader, self.val_loader, manifest = build_loaders(pc)
        fit_vocab_size(config.model, manifest)
        pc.model.vocab_size = config.model.vocab_size
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG).write_text(config.to_yaml())
        ckpt.clear_partial(run_dir)
        torch.manual_seed(config.seed)  # the eager trainer's draw of the initial weights
        self.model = Transformer(config.model).to(device)
        self.model.set_rope(pc.model)
        self.model.set_attention_backend(pc.attention.backend)
        self.optimizer = build_optimizer(self.model, config.train)
        allocate_state(self.optimizer)
        self.metrics = MetricsLog(run_dir, resume_step=0, tensorboard=config.train.tensorboard)
        dtype = matmul_dtype(device, False, pc.train.bf16_gemm)
        self.throughput = Throughput(self.model, pc.data.seq_len, pc.train.global_batch * pc.data.seq_len, device, dtype)
        self.guard = SkipGuard(config)
        self.last_loss, self.last_val = float("nan"), float("nan")
        self.compute_time, self.wall_start = 0.0, time.perf_counter()
        # the newest checkpoint followed by an applied step, and one waiting for its first (as loop.py)
        self.known_good: dict[str, Optional[Path]] = {"last": None, "pending": None}

    @property
    def end(self) -> int:
        return self.phase.end

    def batch(self, step: int, micro: int):
        ptc = self.phase.config.train
        return self.loader.batch(step, micro, ptc.micro_batch, ptc.grad_accum, 0, 1).to(self.device)

    def set_lr(self, step: int) -> float:
        lr = lr_at(step - self.phase.start, self.phase.config.train)
        set_lr(self.optimizer, lr)
        return lr

    def update(self, mean_loss: float) -> tuple[float, Optional[str]]:
        """Clip this member's gradients (already passed to its parameters) and step its optimizer unless
        the skip guard refuses the step: (gradient norm before clipping, why the step was skipped or None)."""
        grad_norm = clip_grad_norm(self.model, self.phase.config.train.grad_clip)
        finite = math.isfinite(mean_loss) and math.isfinite(grad_norm)
        self.last_loss = mean_loss if finite else float("nan")
        reason = self.guard.reason(finite, self.last_loss)
        if reason is None:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.guard.record(reason, self.last_loss)
        if reason is None and self.known_good["pending"] is not None:
            self.known_good["last"], self.known_good["pending"] = self.known_good["pending"], None
        return grad_norm, reason

    def record(self, step: int, lr: float, grad_norm: float, figures: dict, reason: Optional[str], seconds: float) -> dict:
        """Log the metrics row of `step` (just taken, in `seconds`), validating when due; returns the row."""
        pc, ptc = self.phase.config, self.phase.config.train
        self.compute_time += seconds
        speed = self.throughput.update(seconds)
        row = {"step": step, "tokens": tokens_seen([self.phase], step), "loss": self.last_loss, "lr": lr,
               "grad_norm": grad_norm, "tokens_per_s": ptc.global_batch * pc.data.seq_len / seconds,
               "tokens_per_s_per_device": speed["tokens_per_s"],
               **({"mfu": speed["mfu"]} if speed["mfu"] is not None else {}), **figures}
        if reason is not None:
            row.update(skipped=reason, skipped_total=self.guard.skipped)
        if step % ptc.eval_every == 0 or step == self.end:
            self.last_val = evaluate_loss(self.model, self.val_loader, pc, self.device, self.env)
            row["val_loss"] = self.last_val
        if step % ptc.log_every == 0 or "val_loss" in row or reason:
            self.metrics.write(row)
        return row

    def diverged(self, step: int, reason: Optional[str]) -> Optional[TrainingDiverged]:
        """The eager trainer's error when the skip guard is exhausted after `step`, else None."""
        if not self.guard.exhausted:
            return None
        return self.guard.diverged(self.run_dir, step, reason, self.known_good["last"] or self.known_good["pending"])

    def save_if_due(self, step: int) -> None:
        tc = self.config.train
        due = step % tc.checkpoint_every == 0 or step == self.end or step in tc.checkpoint_steps
        if due and self.guard.consecutive == 0:  # a state reached through skipped steps only is not saved
            self.save(step)

    def save_on_stop(self, step: int) -> None:
        """The checkpoint a stop signal leaves before `step` is taken (as loop.py: not after bad steps)."""
        if self.guard.consecutive == 0 and ckpt.latest_checkpoint(self.run_dir) != ckpt.step_dir(self.run_dir, step):
            self.save(step)

    def save(self, step: int) -> None:
        tc, pc = self.config.train, self.phase.config
        extra = {"phase": self.phase.index, "global_batch": pc.train.global_batch, "seq_len": pc.data.seq_len,
                 "data": {"seed": self.config.seed, "next_step": step - self.phase.start}, "phase_results": [],
                 "init_from": None, "branch_from": None}
        every = tc.full_weights == "every" or (tc.full_weights == "auto" and tc.parallel != "fsdp")
        protect = [p for p in (self.known_good["last"],) if p is not None]
        model, optimizer = materialise(self.model, self.optimizer, pc)
        self.known_good["pending"] = ckpt.save_checkpoint(
            self.run_dir, step, model, optimizer, extra, tc.keep_checkpoints, self.env, None,
            full_weights=every or step == self.end, protect=protect, keep_for_good=step in tc.checkpoint_steps)

    def finish(self, step: int) -> TrainResult:
        """result.json of a member that reached its last step."""
        result = TrainResult(
            run_dir=self.run_dir, steps=step, final_train_loss=self.last_loss, final_val_loss=self.last_val,
            tokens=tokens_seen([self.phase], step), wall_time_s=time.perf_counter() - self.wall_start,
            tokens_per_s=tokens_seen([self.phase], step) / self.compute_time if self.compute_time else float("nan"),
            skipped_steps=self.guard.skipped, phases=[], data_passes=data_passes([self.phase], step, lambda phase: self.loader),
        )
        write_result(self.run_dir, result.to_dict())
        return result

    def fail(self, error: TrainingDiverged) -> None:
        (self.run_dir / ERROR_FILE).write_text(f"{error}\n")

    def close(self) -> None:
        """Once the member has left the stack (or the stack has stopped): its metrics closed, its folder unlocked."""
        if self.lock is None:
            return
        self.metrics.close()
        self.lock.release()
        self.lock = None


__all__ = ["ERROR_FILE", "Member", "materialise"]
