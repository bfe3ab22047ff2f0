"""PyTorch's own distributed engine, as the trainer uses it.

`torchrun --nproc_per_node N -m ropelab train ...` sets RANK / WORLD_SIZE / LOCAL_RANK; `init_distributed`
reads them and opens a process group (NCCL on CUDA, gloo on CPU, so that everything is testable
without a GPU). A plain `ropelab train` is a world of one and opens no group.

Model wrapping (`train.parallel`):
  * ``ddp``  – `DistributedDataParallel`: replicated weights, gradients all-reduced in fp32
    (the master weights and gradients stay fp32; bf16 is autocast compute only, as in the seed);
  * ``fsdp`` – FSDP2 `fully_shard` per block and on the root: parameters, gradients and optimizer
    state sharded across ranks (for the 8B preset); bf16 compute with fp32 reduction through
    `MixedPrecisionPolicy` when the run's precision is bf16.
`no_gradient_sync` skips the all-reduce / reduce-scatter on all but the last micro-step of a
gradient-accumulation cycle.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ropelab.config import ConfigError


@dataclass
class DistEnv:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def all_true(self, flag: bool, device: torch.device) -> bool:
        """True only if `flag` holds on every rank (all ranks take the same branch)."""
        if not self.active:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def mean(self, value: float, device: torch.device) -> float:
        return self.sum([value], device)[0] / self.world

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Each value summed over the ranks."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def broadcast_object(self, obj):
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_distributed(device_name: str) -> tuple[DistEnv, torch.device]:
    """The process's place in the job (from torchrun's environment) and its device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    env = DistEnv(rank, world, local_rank)
    device = resolve_device(device_name, local_rank if world > 1 else None)
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return env, device


def resolve_device(name: str, local_rank: int | None) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r}: CUDA is not available on this machine")
    if name == "cuda" and local_rank is not None:
        return torch.device("cuda", local_rank)
    return torch.device(name)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, mode: str, env: DistEnv, device: torch.device, bf16: bool) -> nn.Module:
    """The module the trainer calls: the model itself, DDP around it, or the model sharded in place."""
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not env.active:
            return model
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    if not env.active:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's and DDP's wrappers (FSDP2 shards the model in place)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module, skip: bool):
    """Within the block, backward accumulates local gradients without communicating (if `skip`)."""
    if not skip:
        yield
        return
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global gradient norm (over every rank's shards under FSDP), clipped in place."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
