"""What a study of the claims costs on this machine, before it runs: tokens per run and an expected
time from a few measured training steps of each distinct shape.

The measure is one optimizer step of a fresh model on random tokens at the run's micro-batch and
window (after one warm-up step), on the threads each run gets with `jobs` runs at once. Evaluation,
process start and checkpoints come on top as `OVERHEAD` per run, by the study's engine: ``auto`` forks
its trainers from a warm server (`ropelab.study.warm_start`), which saves the imports. A distillation teacher's forward
passes (once per shared cache with ``teacher_cache``, else once per run) are priced at the FLOP rate
the students' steps reached, times `jobs` (the cache is written on every core before the runs start).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path

import torch

from ropelab.config import ModelConfig
from ropelab.data.tokenizer import load_tokenizer, padded_vocab
from ropelab.model import Transformer
from ropelab.sources.plans import shape_config
from ropelab.sources.loading import load_config
from ropelab.study.frontier import non_embedding_params
from ropelab.study.grid import PlannedRun, StudyConfig, expand
from ropelab.study.plan import phase_counts
from ropelab.study.teacher_cache import shared_caches

# seconds per run: process start, data, evaluations and checkpoints, measured on tiny runs (eager); a warm
# start took an 18-step run of the claims' smallest size from 3.79 to 0.47 s (`benchmarks/engine.py --parts startup`)
OVERHEAD = {"eager": 12.0, "auto": 12.0 - (3.79 - 0.47)}


@functools.lru_cache(maxsize=None)
def _tokenizer_vocab(spec: str, corpus: str) -> int:
    """The padded vocabulary of a tokenizer, loaded once per (spec, corpus) for all runs that share it."""
    return padded_vocab(load_tokenizer(spec, corpus).vocab_size)


def _vocab(run: PlannedRun) -> int:
    return run.config.model.vocab_size or _tokenizer_vocab(run.config.data.tokenizer, run.config.data.corpus)


def step_seconds(model_config: ModelConfig, micro_batch: int, seq_len: int, threads: int) -> float:
    """Seconds of one AdamW training step at this shape, measured."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = Transformer(model_config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(0, model_config.vocab_size, (micro_batch, seq_len + 1))
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            _, loss = model(tokens[:, :-1], targets=tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timings.append(time.perf_counter() - start)
        return timings[-1]
    finally:
        torch.set_num_threads(previous)


def _teacher_shape(name: str, runs: list[PlannedRun]) -> ModelConfig:
    """The teacher's model shape: a run of the study (``"@<run id>"``) or a source."""
    if name.startswith("@"):
        teacher = next(run for run in runs if run.id == name[1:])
        return dataclasses.replace(shape_config(teacher.config.model), vocab_size=_vocab(teacher))
    return shape_config(load_config(name)[0].model)  # outside the meta device: a first call imports the teacher


def _teacher_seconds(study: StudyConfig, runs: list[PlannedRun], flop_rate: float) -> float:
    """Seconds of the teacher's forward passes over the tokens it scores: once per shared cache with
    ``teacher_cache``, else in every student that names it."""
    kd = [run for run in runs if run.config.distill is not None and run.config.distill.teacher]
    if not kd:
        return 0.0
    if study.teacher_cache:
        firsts: dict = {}
        for run_id, folder in shared_caches(kd, Path("study")).items():
            firsts.setdefault(folder, next(run for run in kd if run.id == run_id))
        kd = list(firsts.values())
    seconds = 0.0
    teachers: dict[str, Transformer] = {}
    for run in kd:
        name = run.config.distill.teacher
        if name not in teachers:
            shape = _teacher_shape(name, runs)
            with torch.device("meta"):
                teachers[name] = Transformer(shape)
        for count in phase_counts(run.config):
            seq = count.phase.config.data.seq_len
            seconds += count.tokens * teachers[name].flops_per_token(seq) / 3 / flop_rate  # forward: a third of a step
    return seconds


def study_estimate(study: StudyConfig, jobs: int = 1, measure: bool = True) -> dict:
    """{"runs": [{run, steps, tokens, params, tokens_per_param, seconds}], "tokens", "tokens_per_param",
    "teacher_seconds", "seconds"}. `steps` and `tokens` are what the run trains itself, as
    `ropelab.study.plan.phase_counts` counts them (a branch starts at its parent's step),
    `tokens_per_param` what its model has seen at the end per non-embedding parameter (the study's: the
    largest); `seconds` is the wall time expected with `jobs` runs at once (None without `measure`)."""
    runs = expand(study)
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    measured: dict[tuple, float] = {}
    rates = []
    rows = []
    for run in runs:
        vocab = _vocab(run) if measure else None
        counts = phase_counts(run.config)
        seconds = OVERHEAD[study.engine]
        for count in counts:
            phase = count.phase
            tc, seq = phase.config.train, phase.config.data.seq_len
            if measure:
                shape = dataclasses.replace(shape_config(phase.config.model), vocab_size=vocab)
                key = (repr(shape), tc.micro_batch, seq)
                if key not in measured:
                    measured[key] = step_seconds(shape, tc.micro_batch, seq, threads)
                    with torch.device("meta"):
                        flops = Transformer(shape).flops_per_token(seq) * tc.micro_batch * seq
                    rates.append(flops / measured[key])
                seconds += count.trained_steps * tc.grad_accum * measured[key]
        params = non_embedding_params(run.config.model)
        rows.append({"run": run.id, "steps": sum(c.trained_steps for c in counts),
                     "tokens": sum(c.trained_tokens for c in counts), "params": params,
                     "tokens_per_param": sum(c.tokens for c in counts) / params, "seconds": seconds if measure else None})
    totals = {"runs": rows, "tokens": sum(r["tokens"] for r in rows),
              "tokens_per_param": max(r["tokens_per_param"] for r in rows)}
    if not measure:
        return {**totals, "teacher_seconds": None, "seconds": None}
    teacher = _teacher_seconds(study, runs, max(rates) * max(1, jobs))
    return {**totals, "teacher_seconds": teacher, "seconds": teacher + sum(r["seconds"] for r in rows) / max(1, jobs)}
