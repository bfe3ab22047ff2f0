"""`train_stacked`: several fresh runs of one shape trained as one stacked model in one process
(`ropelab.train.stacked_model`; HFTA, Wang et al., MLSys 2021), each run's folder what a separate eager
`ropelab train` writes (`ropelab.train.stacked_member`).

Every step, each member takes its own batch (its loaders, its seed's data order), its own learning
rate, gradient clipping, skip guard and AdamW step; the forward and backward run once for the stack.
A member that reaches its last step writes result.json and leaves the stack; one whose skip guard is
exhausted leaves it with error.txt holding the eager trainer's `TrainingDiverged` line, and the others
go on. A stop signal (`ropelab.train.stop`) checkpoints every member still training at the next step
boundary and raises `StoppedBySignal` (exit 75 after SIGTERM or SIGUSR1): each member then resumes
alone with `ropelab train --out MEMBER --resume`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ropelab.allocator import reuse_freed_memory
from ropelab.config import ConfigError, RunConfig
from ropelab.errors import is_storage_error
from ropelab.files import refuse_links_out
from ropelab.train.distributed import init_distributed
from ropelab.train.interrupted import stopped_by_signal, write_failed
from ropelab.train.lock import RunLock
from ropelab.train.loop import TrainResult
from ropelab.train.run_folder import check_new_run_folder
from ropelab.train.stacked_member import Member
from ropelab.train.stacked_model import StackedTransformer, stack_refusal
from ropelab.train.stop import StoppedBySignal, StopSignals

# callback(member index in the configs given, its metrics row) after each of its steps
MemberCallback = Callable[[int, dict], None]


def train_stacked(configs: list[RunConfig], out_dirs: list[str | Path],
                  callbacks: tuple[MemberCallback, ...] = ()) -> list[Optional[TrainResult]]:
    """Train fresh runs `configs` into `out_dirs` as one stack. Returns each member's result, None for
    a member that diverged (its folder holds error.txt). Raises a one-line ConfigError when the runs
    cannot stack (`stack_refusal`) or a folder is not new, and `StoppedBySignal` on a stop signal."""
    if len(configs) != len(out_dirs):
        raise ConfigError(f"train-stacked: {len(configs)} configs for {len(out_dirs)} output folders")
    run_dirs = [Path(d) for d in out_dirs]
    if len({d.resolve() for d in run_dirs}) != len(run_dirs):
        raise ConfigError("train-stacked: two members write into one folder; give each its own")
    configs = [config.validate() for config in configs]
    reason = stack_refusal(configs)
    if reason is not None:
        raise ConfigError(f"train-stacked: {reason}")
    for run_dir in run_dirs:
        refuse_links_out(run_dir, "ropelab train-stacked")
        check_new_run_folder(run_dir)
    env, device = init_distributed(configs[0].train.device)
    if env.world > 1:
        raise ConfigError("train-stacked: runs in one process; start it without torchrun")
    stop = StopSignals()
    locks: list[RunLock] = []
    members: list[Member] = []
    try:
        for run_dir in run_dirs:
            locks.append(RunLock(run_dir).acquire())
            check_new_run_folder(run_dir, probe_lock=False)  # another run may have finished there meanwhile
        if device.type == "cpu" and all(config.train.reuse_freed_memory for config in configs):
            reuse_freed_memory()
        for config, run_dir, lock in zip(configs, run_dirs, locks):
            members.append(Member(config, run_dir, device, env, lock))
        return run_stack(members, stop, callbacks)
    except OSError as exc:
        if not is_storage_error(exc):
            raise
        raise write_failed(run_dirs[0], exc) from None
    finally:
        stop.close()
        for member in members:
            member.close()
        for lock in locks[len(members):]:  # folders whose member was not made
            lock.release()


def run_stack(members: list[Member], stop: StopSignals, callbacks: tuple[MemberCallback, ...]
              ) -> list[Optional[TrainResult]]:
    """The training loop over the stack, from step 0 until every member has finished or failed."""
    results: list[Optional[TrainResult]] = [None] * len(members)
    active = list(range(len(members)))
    stack = StackedTransformer([m.model for m in members])
    shared = members[0].phase.config
    grad_accum, backend = shared.train.grad_accum, shared.attention.backend
    step = 0
    while active:
        if stop.requested_on_any_rank(members[0].env, members[0].device):
            for index in active:
                members[index].save_on_stop(step)
            lines = [str(stopped_by_signal(stop.signum, step, members[index].run_dir)) for index in active]
            raise StoppedBySignal(stop.signum, " | ".join(lines))
        started = time.perf_counter()
        lrs = [members[index].set_lr(step) for index in active]
        loss_sums = [0.0] * len(active)
        for micro in range(grad_accum):
            batches = [members[index].batch(step, micro) for index in active]
            losses = stack(torch.stack([b.input_ids for b in batches]), torch.stack([b.labels for b in batches]),
                           torch.stack([b.position_ids for b in batches]), backend)  # (N,)
            (losses.sum() / grad_accum).backward()
            loss_sums = [total + loss for total, loss in zip(loss_sums, losses.tolist())]
        stack.pass_gradients()
        updates = [members[index].update(total / grad_accum) for index, total in zip(active, loss_sums)]
        seconds = time.perf_counter() - started
        step += 1
        leaving = []
        for slot, index in enumerate(active):
            member = members[index]
            grad_norm, reason = updates[slot]
            row = member.record(step, lrs[slot], grad_norm, {"ce": loss_sums[slot] / grad_accum}, reason, seconds)
            for callback in callbacks:
                callback(index, row)
            error = member.diverged(step, reason)
            if error is not None:
                member.fail(error)
                member.close()
                leaving.append(index)
                continue
            member.save_if_due(step)
            if step == member.end:
                results[index] = member.finish(step)
                member.close()
                leaving.append(index)
        if leaving:
            active = [index for index in active if index not in leaving]
            if active:
                stack = StackedTransformer([members[index].model for index in active])
    return results


__all__ = ["MemberCallback", "run_stack", "train_stacked"]
