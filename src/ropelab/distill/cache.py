"""Offline KD: the teacher's top-k log-probabilities for exactly the batches a run will see, on disk.

  cache_teacher_logits(config, out_dir, steps, dry_run)   writes the cache (or, dry, prints its size)
  CachedTeacher(folder, config)                           serves it to `DistillObjective` like a live teacher

The trainer's batches are a pure function of (seed, step, micro-step, rank) (`ropelab.data.loader`),
so the cache holds ``loader.batch(step, micro, micro_batch, grad_accum, rank, world)`` of every
phase of the run (`ropelab.train.phases`; steps counted from the phase start), every micro-step
and every data-parallel rank, computed like the live teacher (`teacher_topk` at the KD
temperature, chunk by chunk). Each batch is filed under a content key (a hash of its token ids and
positions), so serving needs no step counter, and a batch the cache does not hold is an error,
never another batch's targets.

Folder:
  manifest.json               teacher, temperature, k, dtype; per phase the settings the targets
                              depend on (data, batch shape, document mask) and its step count;
                              the shards; key -> [shard, index]
  shard_NNNNN.logprobs.bin    (batches, micro_batch, seq_len, k) log-probabilities, fp16 or fp32
  shard_NNNNN.ids.bin         the same shape, int32 token ids
Raw arrays, memory-mapped when read, so the size is known before anything is written:
batches * micro_batch * seq_len * k * (2 or 4, + 4) bytes summed over phases, plus the manifest.
fp16 log-probabilities keep about 3 significant digits (an error near 0.01 at log p = -20).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ropelab.config import ConfigError, RunConfig
from ropelab.data.pipeline import build_loaders
from ropelab.distill.teacher import check_teacher, load_teacher
from ropelab.files import new_folder
from ropelab.train.distributed import resolve_device
from ropelab.train.loss import TeacherTopK, teacher_topk
from ropelab.train.phases import resolve_phases

DTYPES = {"fp16": np.float16, "fp32": np.float32}
MANIFEST = "manifest.json"


def batch_key(input_ids: torch.Tensor, position_ids: torch.Tensor) -> str:
    digest = hashlib.sha1()
    for t in (input_ids, position_ids):
        digest.update(t.detach().cpu().numpy().astype(np.int64).tobytes())
    return digest.hexdigest()


def cache_settings(config: RunConfig) -> dict:
    """What the teacher targets of one phase's batches depend on, besides the teacher's weights."""
    d, t = config.data, config.train
    return {
        "temperature": config.distill.temperature, "seed": config.seed, "data.corpus": d.corpus,
        "data.tokenizer": d.tokenizer, "data.seq_len": d.seq_len, "data.positions": d.positions,
        "train.micro_batch": t.micro_batch, "train.grad_accum": t.grad_accum, "world": t.data_parallel or 1,
        "attention.doc_mask": config.attention.doc_mask,
    }


def _phase_plan(config: RunConfig, steps: Optional[int]) -> list[tuple]:
    """[(phase, steps cached in it)] for the first `steps` global steps (all when None)."""
    phases = resolve_phases(config, config.train.data_parallel or 1)
    end = phases[-1].end if steps is None else steps
    return [(p, min(p.end, end) - p.start) for p in phases if min(p.end, end) > p.start]


def _batch_bytes(config: RunConfig, k: int, dtype: str) -> int:
    return config.train.micro_batch * config.data.seq_len * k * (np.dtype(DTYPES[dtype]).itemsize + 4)


def cache_size(config: RunConfig, k: int, steps: Optional[int] = None, dtype: str = "fp16") -> tuple[int, int]:
    """(batches, bytes of the shard files) of a cache of the run's first `steps` steps (default: all)
    at top-k `k`; every phase, every micro-step and every data-parallel rank."""
    batches = total = 0
    for phase, n in _phase_plan(config, steps):
        t = phase.config.train
        count = n * t.grad_accum * t.data_parallel
        batches += count
        total += count * _batch_bytes(phase.config, k, dtype)
    return batches, total


def _progress(enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("[bold]teacher logits"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    disable=not enabled)


def cache_teacher_logits(config: RunConfig, out_dir: str | Path, steps: Optional[int] = None, dry_run: bool = False,
                         dtype: str = "fp16", shard_bytes: int = 2**30) -> int:
    """Write the teacher's top-k log-probabilities (k = `distill.top_k`, else the whole vocabulary)
    for the run's first `steps` optimizer steps (default: all of them, across `train.phases`) into
    the new folder `out_dir`. Prints and returns the byte size of the shard files; `dry_run` stops
    there. The teacher and the folder are checked before anything is computed."""
    config = config.validate()
    distill = config.distill
    if distill is None or not distill.teacher:
        raise ConfigError("distill.teacher: a logits cache is computed by a live teacher; set distill.teacher")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    if steps is not None and steps <= 0:
        raise ConfigError(f"steps={steps}: must be > 0")
    info = check_teacher(config)
    k = distill.top_k or info.vocab
    batches, total = cache_size(config, k, steps, dtype)
    print(f"logits cache: {batches:,} batches, top-{k} {dtype} log-probs + int32 ids per token "
          f"= {total:,} bytes ({total / 2**30:.3f} GiB)")
    if dry_run:
        return total
    _write(config, Path(out_dir), _phase_plan(config, steps), k, dtype, batches, shard_bytes)
    return total


def _append(files, teacher, batch, config: RunConfig, k: int, dtype: str) -> None:
    """Append one batch's top-k log-probabilities and ids to the open shard files, chunk by chunk."""
    f_logp, f_ids = files
    distill = config.distill
    doc_ids = batch.doc_ids if config.attention.doc_mask else None
    targets = teacher.targets(batch.input_ids, batch.position_ids, doc_ids)
    for rows in torch.arange(batch.input_ids.numel(), device=teacher.device).split(distill.chunk_tokens):
        logp, ids = teacher_topk(targets.logits(rows), distill.temperature, k)
        logp.cpu().numpy().astype(DTYPES[dtype]).tofile(f_logp)
        ids.cpu().numpy().astype(np.int32).tofile(f_ids)


def _write(config: RunConfig, out: Path, plan: list[tuple], k: int, dtype: str, batches: int, shard_bytes: int) -> None:
    with new_folder(out) as tmp:
        teacher = load_teacher(config, resolve_device(config.train.device, None))
        entries, shards, phases = {}, [], []
        with _progress(config.train.progress) as progress:
            task = progress.add_task("cache", total=batches)
            for phase, n in plan:
                pc, t = phase.config, phase.config.train
                loader = build_loaders(pc)[0]
                order = [(s, m, r) for s in range(n) for m in range(t.grad_accum) for r in range(t.data_parallel)]
                per_shard = max(1, shard_bytes // _batch_bytes(pc, k, dtype))
                for start in range(0, len(order), per_shard):
                    name, part = f"shard_{len(shards):05d}", order[start:start + per_shard]
                    with open(tmp / f"{name}.logprobs.bin", "wb") as f_logp, open(tmp / f"{name}.ids.bin", "wb") as f_ids:
                        for index, (step, micro, rank) in enumerate(part):
                            batch = loader.batch(step, micro, t.micro_batch, t.grad_accum, rank, t.data_parallel)
                            _append((f_logp, f_ids), teacher, batch, pc, k, dtype)
                            entries[batch_key(batch.input_ids, batch.position_ids)] = [len(shards), index]
                            progress.advance(task)
                    shards.append({"name": name, "shape": [len(part), t.micro_batch, pc.data.seq_len, k]})
                phases.append({"name": phase.name, "steps": n, "settings": cache_settings(pc)})
        manifest = {"format": 1, "teacher": config.distill.teacher, "top_k": k, "dtype": dtype,
                    "temperature": config.distill.temperature, "phases": phases, "shards": shards, "entries": entries}
        (tmp / MANIFEST).write_text(json.dumps(manifest))


class CachedTeacher:
    """Teacher targets from a cache folder, looked up by batch content (`targets` as `Teacher.targets`).

    Given the run's `config` (or one phase's), refuses a cache that lacks one of its phases: other
    settings (temperature, data, batch shape, document mask) or fewer steps; and a `distill.top_k`
    above the cached k."""

    def __init__(self, folder: str | Path, config: Optional[RunConfig] = None):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            raise ConfigError(f"distill.logits_cache={str(folder)!r}: no {MANIFEST}; write one with `ropelab distill --cache`")
        self.manifest = json.loads(path.read_text())
        self.k = self.manifest["top_k"]
        self.temperature = self.manifest["temperature"]
        if config is not None:
            self._check(config)
        dtype = DTYPES[self.manifest["dtype"]]
        self.shards = [
            tuple(np.memmap(self.folder / f"{s['name']}.{part}.bin", dtype=dt, mode="r", shape=tuple(s["shape"]))
                  for part, dt in (("logprobs", dtype), ("ids", np.int32)))
            for s in self.manifest["shards"]
        ]

    def _check(self, config: RunConfig) -> None:
        where = f"distill.logits_cache={str(self.folder)!r}"
        top_k = config.distill.top_k
        if top_k is not None and top_k > self.k:
            raise ConfigError(f"distill.top_k={top_k}: the logits cache holds only the top {self.k}")
        cached = self.manifest["phases"]
        for phase, steps in _phase_plan(config, None):
            wanted = cache_settings(phase.config)
            if any(c["settings"] == wanted and c["steps"] >= steps for c in cached):
                continue
            closest = cached[min(phase.index, len(cached) - 1)]
            for key, value in wanted.items():
                if closest["settings"][key] != value:
                    raise ConfigError(f"{where}: written for {key}={closest['settings'][key]!r}, the run's phase "
                                      f"{phase.name!r} has {value!r}; write a cache for this run with `ropelab distill --cache`")
            raise ConfigError(f"{where}: holds {closest['steps']} steps of phase {closest['name']!r}, "
                              f"the run's phase {phase.name!r} needs {steps}")

    def targets(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                out_device: Optional[torch.device] = None) -> TeacherTopK:
        """The cached targets of this batch; `doc_ids` is accepted for the `Teacher` call shape (the
        cache records whether the teacher saw document masks)."""
        entry = self.manifest["entries"].get(batch_key(input_ids, position_ids))
        if entry is None:
            raise ConfigError(f"distill.logits_cache={str(self.folder)!r}: holds no teacher logits for this batch; "
                              "write a cache for this run with `ropelab distill --cache`")
        logprobs, ids = (torch.from_numpy(np.array(a[entry[1]])) for a in self.shards[entry[0]])
        device = out_device if out_device is not None else "cpu"
        return TeacherTopK(logprobs.to(device), ids.to(device), self.temperature)


__all__ = ["CachedTeacher", "batch_key", "cache_size", "cache_teacher_logits"]
