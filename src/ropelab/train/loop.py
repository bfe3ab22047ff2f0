"""The training loop: one process or a `torchrun` job (DDP or FSDP2), gradient accumulation,
bf16 autocast, phases, periodic validation, crash-safe checkpoints, exact resume, a checkpoint
and a clean stop on SIGTERM, SIGUSR1 or Ctrl-C (`ropelab.train.stop`), and non-finite / spiking
steps skipped before they touch the weights.

What a run directory holds is `ropelab.sources.runs`. The loss is an objective
(`ropelab.train.objectives`): cross-entropy, or one a feature registered for its config section
(distillation); anything else outside the loop plugs in as a callback. Around the loop: where a
resume starts (`ropelab.train.resume`), the validation loss (`ropelab.train.validation`), which
steps are skipped (`ropelab.train.skip_guard`), and the one-line stops (`ropelab.train.interrupted`).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Callable, Optional

import torch

from ropelab.allocator import reuse_freed_memory
from ropelab.config import PLAN_KEYS, ConfigError, RunConfig
from ropelab.data.loader import PackedLoader
from ropelab.data.pipeline import build_loaders, fit_vocab_size
from ropelab.errors import is_storage_error
from ropelab.files import refuse_links_out
from ropelab.model import Transformer, model_summary
from ropelab.precision import matmul_dtype
from ropelab.sources.init import check_init, initial_weights
from ropelab.sources.runs import CONFIG, read_result, read_run_config, write_result
from ropelab.train import checkpoint as ckpt
from ropelab.train.autocast import autocast, uses_bf16
from ropelab.train.branch import BranchPoint, branch_point
from ropelab.train.distributed import (
    DistEnv, clip_grad_norm, init_distributed, no_gradient_sync, shutdown_distributed, wrap_model,
)
from ropelab.train.interrupted import stopped_by_signal, write_failed
from ropelab.train.lock import RunLock
from ropelab.train.metrics import MetricsLog
from ropelab.train.objectives import Objective, build_objective
from ropelab.train.optim import allocate_state, build_optimizer, lr_at, set_lr
from ropelab.train.phases import Phase, base_warnings, phase_at, resolve_phases, tokens_seen
from ropelab.train.progress import model_status, progress_bar, step_status
from ropelab.train.resume import check_resume_world, own_checkpoint, resume_checkpoint
from ropelab.train.run_folder import check_new_run_folder
from ropelab.train.skip_guard import SkipGuard
from ropelab.train.stop import StopSignals
from ropelab.train.throughput import Throughput
from ropelab.train.validation import evaluate_loss

Callback = Callable[[dict], None]

__all__ = ["COMPILE_ENV", "data_passes", "train", "TrainResult"]

COMPILE_ENV = "ROPELAB_COMPILE"  # "1": compile the forward as train.compile does, config.yaml unchanged


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_train_loss: float
    final_val_loss: float
    tokens: int
    wall_time_s: float
    tokens_per_s: float
    skipped_steps: int = 0
    phases: list = field(default_factory=list)  # [{"name", "end_step", "val_loss"}]
    init_from: Optional[dict] = None  # where the step-0 weights came from (`train.init_from`)
    branch_from: Optional[dict] = None  # the checkpoint this run continues (`train.branch_from`)
    data_passes: Optional[float] = None  # training windows drawn over the run / windows in its training split (`data_passes`)

    def to_dict(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


# the keys a finished run's result.json must hold for `TrainResult` (run_dir is the folder itself)
TRAIN_RESULT_KEYS = tuple(f.name for f in fields(TrainResult)
                          if f.name != "run_dir" and f.default is MISSING and f.default_factory is MISSING)


def data_passes(phases: list[Phase], step: int, train_loader: Callable[[Phase], PackedLoader]) -> float:
    """How many times over its training split the run has read by `step`: each phase's windows drawn
    (its steps x global batch, counted from step 0 as a branch's data position is) over the windows its
    split holds, summed over the phases. Above 1, windows came round again (a new order each pass)."""
    passes = 0.0
    for phase in phases:
        steps = max(0, min(step, phase.end) - phase.start)
        if steps:
            passes += steps * phase.config.train.global_batch / train_loader(phase).num_windows
    return passes


def train(
    config: Optional[RunConfig] = None,
    out_dir: str | Path = "runs/default",
    resume: bool = False,
    callbacks: tuple[Callback, ...] = (),
    objective: Optional[Objective] = None,
    from_checkpoint: Optional[str | Path] = None,
) -> TrainResult:
    """Train (or resume) one run in `out_dir`; under `torchrun` every rank calls this. Returns the
    final figures. `resume` continues from the newest complete checkpoint, or from
    `from_checkpoint` (a checkpoint folder, or a step number) when given. `objective` replaces
    the loss (default: cross-entropy, or distillation when the config has a `distill` section)."""
    run_dir = Path(out_dir)
    refuse_links_out(run_dir, "ropelab train")  # before anything is read or written there
    if from_checkpoint is not None:  # first: a foreign checkpoint is refused even on a run with nothing left to do
        from_checkpoint = own_checkpoint(run_dir, from_checkpoint)
    if resume:
        config = read_run_config(run_dir)
    else:
        config = (config or RunConfig()).validate()
    env, device = init_distributed(config.train.device)
    started_group = env.active
    branch = None
    if not resume:  # before the run directory is made: a mismatch leaves nothing behind
        if config.train.init_from:
            check_init(config)
        if config.train.branch_from:
            branch = branch_point(config)
        resolve_phases(config)  # each phase's config, and the windows against the longest phase
        check_new_run_folder(run_dir, probe_lock=env.is_main)  # before RunLock makes the folder and its .lock
    stop = StopSignals()  # from here on a stop signal waits for the loop's next step boundary (`ropelab.train.stop`)
    lock = None
    try:
        lock = RunLock(run_dir).acquire() if env.is_main else None  # inside: a full disk fails in one line
        return _train(config, run_dir, resume, callbacks, objective, from_checkpoint, env, device, stop, branch)
    except OSError as exc:
        if not is_storage_error(exc):
            raise
        raise write_failed(run_dir, exc) from None
    finally:
        stop.close()
        if lock is not None:
            lock.release()
        if started_group:
            shutdown_distributed()


def _train(config, run_dir, resume, callbacks, objective, from_checkpoint, env: DistEnv, device, stop: StopSignals,
           branch: Optional[BranchPoint] = None) -> TrainResult:
    config_path = run_dir / CONFIG
    tc = config.train
    if tc.data_parallel is not None and tc.data_parallel != env.world and not resume:
        raise ConfigError(
            f"train.data_parallel={tc.data_parallel}: this job has {env.world} process(es); set train.data_parallel="
            f"{env.world} (or drop it) and scale train.grad_accum to keep the global batch"
        )
    start_step, latest = 0, None
    if resume:
        result = read_result(run_dir, TRAIN_RESULT_KEYS)
        if result is not None:
            if env.is_main:
                print(f"{run_dir}: run already finished at step {result['steps']}; nothing to do")
            return TrainResult(**{**result, "run_dir": run_dir})
        latest = resume_checkpoint(run_dir, from_checkpoint, tc.verify_checkpoints, env)
    else:
        check_new_run_folder(run_dir, probe_lock=False)
    env.barrier()  # every rank has checked the run directory before rank 0 writes to it

    phases = resolve_phases(config, env.world)
    if env.is_main and not resume:
        for line in base_warnings(phases):
            print(line, file=sys.stderr)
    config.train.steps = phases[-1].end
    loaders = {}

    def loaders_for(phase: Phase) -> tuple[PackedLoader, PackedLoader, dict]:
        if phase.index not in loaders:
            loaders[phase.index] = build_loaders(phase.config)
        return loaders[phase.index]

    fit_vocab_size(config.model, loaders_for(phases[0])[2])
    for phase in phases:
        phase.config.model.vocab_size = config.model.vocab_size
    weights, init_record = None, None
    if tc.init_from and latest is None:
        # Before config.yaml is written: converting to a 2-norm plan writes the pairs chosen into config.model.
        weights, init_record = initial_weights(config, loaders_for(phases[0])[:2])
        for phase in phases:
            phase.config.model.rope_layers = copy.deepcopy(config.model.rope_layers)
            for key in PLAN_KEYS:
                setattr(phase.config.model.rope, key, getattr(config.model.rope, key))
    if env.is_main and not resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path.write_text(config.to_yaml())
    if env.is_main:
        ckpt.clear_partial(run_dir)

    if tc.reuse_freed_memory and device.type == "cpu":
        reuse_freed_memory()
    torch.manual_seed(config.seed)
    # weights that a source, a checkpoint or a branch gives in full next are not drawn first
    model = Transformer(config.model, init=weights is None and latest is None and branch is None)
    if weights is not None:
        model.load_state_dict(weights)
        del weights
    model = model.to(device)
    wrapped = wrap_model(model, tc.parallel, env, device, uses_bf16(config, device))
    optimizer = build_optimizer(wrapped, tc)
    phase_results = []  # {"name", "end_step", "val_loss"} of the phases completed so far
    branch_record = branch.record() if branch else None
    if latest is not None:  # verified above: the loads below check sizes only
        state = ckpt.read_state(latest, verify="sizes")
        check_resume_world(state, phases, env, latest)
        ckpt.load_checkpoint(latest, wrapped, optimizer, env, verify="sizes")
        branch_record = state.get("branch_from")
    elif branch is not None:  # a branch may change the batch: its data position is its own step
        state = ckpt.read_state(branch.checkpoint)
        ckpt.load_checkpoint(branch.checkpoint, wrapped, optimizer, env)
    if latest is not None or branch is not None:
        start_step = state["step"]
        phase_results = state.get("phase_results", [])
        init_record = state.get("init_from")
    allocate_state(optimizer)  # a fresh run's moments before any activation (resumed: already loaded)
    # a study's `auto` engine compiles through the environment, so that config.yaml stays the eager run's
    forward = torch.compile(wrapped) if tc.compile or os.environ.get(COMPILE_ENV) == "1" else wrapped
    objectives: dict[int, Objective] = {}
    throughputs: dict[int, Throughput] = {}

    def throughput_for(phase: Phase) -> Throughput:
        """Per-device tokens/s and MFU over recent steps (phases differ in length and batch)."""
        if phase.index not in throughputs:
            pc = phase.config
            dtype = matmul_dtype(device, uses_bf16(pc, device), pc.train.bf16_gemm)
            per_device = pc.train.global_batch * pc.data.seq_len // env.world
            throughputs[phase.index] = Throughput(model, pc.data.seq_len, per_device, device, dtype)
        return throughputs[phase.index]

    def objective_for(phase: Phase) -> Objective:
        """The run's objective for this phase; a phase may reuse what the previous one loaded (a teacher)."""
        if objective is not None:
            return objective
        if phase.index not in objectives:
            previous = objectives.get(phase.index - 1)
            objectives[phase.index] = build_objective(phase.config, device, previous)
        return objectives[phase.index]

    metrics = MetricsLog(run_dir, resume_step=start_step, tensorboard=tc.tensorboard) if env.is_main else None
    summary = model_summary(model)
    guard = SkipGuard(config)
    last_loss, last_val = float("nan"), float("nan")
    wall_start, compute_time = time.perf_counter(), 0.0
    step = start_step

    # The newest checkpoint followed by an applied step (or the one resumed from): never pruned, and
    # the one named when bad steps stop the run. `pending` waits for its first applied step.
    known_good = {"last": latest, "pending": None}

    def save(at_step: int, phase: Phase) -> None:
        extra = {"phase": phase.index, "global_batch": phase.config.train.global_batch, "seq_len": phase.config.data.seq_len,
                 "data": {"seed": config.seed, "next_step": at_step - phase.start}, "phase_results": phase_results,
                 "init_from": init_record, "branch_from": branch_record}
        phase_end = phase.name if at_step == phase.end and len(phases) > 1 else None
        every = tc.full_weights == "every" or (tc.full_weights == "auto" and tc.parallel != "fsdp")
        protect = [p for p in (known_good["last"],) if p is not None]
        known_good["pending"] = ckpt.save_checkpoint(run_dir, at_step, wrapped, optimizer, extra, tc.keep_checkpoints, env,
                                                     phase_end, full_weights=every or at_step == phase.end, protect=protect,
                                                     keep_for_good=at_step in tc.checkpoint_steps)

    progress = progress_bar(tc.progress and env.is_main)
    phase = phase_at(phases, step)
    try:
        with progress:
            task = progress.add_task("train", total=phases[-1].end, completed=start_step, status=model_status(summary))
            if tc.init_from and start_step == 0 and latest is None:  # where the source's weights start: the curve's first point
                pc = phases[0].config
                model.set_rope(pc.model)
                last_val = evaluate_loss(forward, loaders_for(phases[0])[1], pc, device, env)
                if metrics:
                    metrics.write({"step": 0, "tokens": 0, "val_loss": last_val})
                if phases[-1].end == 0:  # train.steps 0: the converted or copied weights are the run
                    save(0, phases[0])
            while step < phases[-1].end:
                phase = phase_at(phases, step)
                if stop.requested_on_any_rank(env, device):  # before the first step too: a stop always leaves a checkpoint
                    if guard.consecutive == 0 and ckpt.latest_checkpoint(run_dir) != ckpt.step_dir(run_dir, step):
                        save(step, phase)
                    raise stopped_by_signal(stop.signum, step, run_dir)
                pc = phase.config
                ptc = pc.train
                if step == phase.start or step == start_step:  # entering a phase (or resuming inside one)
                    model.set_rope(pc.model)
                    model.set_attention_backend(pc.attention.backend)
                    model.set_activation_checkpointing(ptc.activation_checkpointing)
                loader, val_loader, _ = loaders_for(phase)
                tokens_per_step = ptc.global_batch * pc.data.seq_len
                t0 = time.perf_counter()
                lr = lr_at(step - phase.start, ptc)
                set_lr(optimizer, lr)
                loss_sum, extras = 0.0, {}
                for micro in range(ptc.grad_accum):
                    batch = loader.batch(step - phase.start, micro, ptc.micro_batch, ptc.grad_accum, env.rank, env.world)
                    batch = batch.to(device)
                    with no_gradient_sync(wrapped, skip=micro < ptc.grad_accum - 1):
                        with autocast(pc, device):
                            loss, logged = objective_for(phase)(forward, batch)
                        (loss / ptc.grad_accum).backward()
                    loss_sum += loss.item()
                    for key, value in logged.items():
                        extras[key] = extras.get(key, 0.0) + value / ptc.grad_accum
                grad_norm = clip_grad_norm(wrapped, ptc.grad_clip)
                local_loss = loss_sum / ptc.grad_accum
                finite = env.all_true(math.isfinite(local_loss) and math.isfinite(grad_norm), device)
                last_loss = env.mean(local_loss, device) if finite else float("nan")
                reason = guard.reason(finite, last_loss)
                if reason is None:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                guard.record(reason, last_loss)
                if reason is None and known_good["pending"] is not None:
                    known_good["last"], known_good["pending"] = known_good["pending"], None
                step += 1
                dt = time.perf_counter() - t0
                compute_time += dt
                speed = throughput_for(phase).update(dt)
                row = {"step": step, "tokens": tokens_seen(phases, step), "loss": last_loss, "lr": lr,
                       "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt,
                       "tokens_per_s_per_device": speed["tokens_per_s"],
                       **({"mfu": speed["mfu"]} if speed["mfu"] is not None else {}),
                       **{k: env.mean(v, device) for k, v in extras.items()}}
                if len(phases) > 1:
                    row["phase"] = phase.name
                if reason is not None:
                    row.update(skipped=reason, skipped_total=guard.skipped)
                if step % ptc.eval_every == 0 or step == phase.end:
                    last_val = evaluate_loss(forward, val_loader, pc, device, env)
                    row["val_loss"] = last_val
                if step == phase.end and len(phases) > 1:
                    phase_results.append({"name": phase.name, "end_step": step, "val_loss": last_val})
                if metrics and (step % ptc.log_every == 0 or "val_loss" in row or reason):
                    metrics.write(row)
                for callback in callbacks:
                    callback(row)
                if guard.exhausted:
                    raise guard.diverged(run_dir, step, reason, known_good["last"] or known_good["pending"])
                # a state reached through skipped steps only is not saved: its data position is past bad batches
                due = step % ptc.checkpoint_every == 0 or step == phase.end or step in tc.checkpoint_steps
                if due and guard.consecutive == 0:
                    save(step, phase)
                progress.update(task, completed=step, status=step_status(phase.name if len(phases) > 1 else "", last_loss,
                                                                        last_val, row["tokens_per_s"], speed["mfu"]))
    finally:
        if metrics:
            metrics.close()

    trained_tokens = tokens_seen(phases, step) - tokens_seen(phases, start_step)
    passes = data_passes(phases, step, lambda phase: loaders_for(phase)[0])
    result = TrainResult(
        run_dir=run_dir, steps=step, final_train_loss=last_loss, final_val_loss=last_val,
        tokens=tokens_seen(phases, step), wall_time_s=time.perf_counter() - wall_start,
        tokens_per_s=trained_tokens / compute_time if compute_time else float("nan"),
        skipped_steps=guard.skipped, phases=phase_results, init_from=init_record, branch_from=branch_record,
        data_passes=passes,
    )
    if env.is_main:
        write_result(run_dir, result.to_dict())
    return result

