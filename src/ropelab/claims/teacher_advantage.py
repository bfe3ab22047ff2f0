"""The teacher's advantage, measured before any 001 verdict: does the teacher know more about long
context than a student trained by CE on short data?

The distillation seed's claims are about a student learning long context from a teacher that has it;
they can only be judged when the teacher has it and the short-data student lacks it. Two measures, on
the same held-out data for both models:

  loss by position   next-token loss on windows of the teacher's length cut at random offsets inside
                     held-out long documents (`ropelab.evaluate.longctx.position_windows`, place
                     "inside": a few long documents give many windows, and a range of positions is
                     not always the same part of a document, such as a play's title page),
                     averaged over doubling ranges of positions: (S/2, S], (S, 2S], (2S, 4S], ... up to
                     the window, S the students' short window;
  retrieval          passkey accuracy at 1x-8x S (`ropelab.evaluate.retrieval`), judged pooled over 4x
                     and 8x, with its 95% Wilson interval against chance.

The teacher has the advantage only when (1) its loss keeps falling with position beyond S: lower in
every doubling range than in the one before, from (S/2, S] to the last, and the whole fall (first range
minus last, paired per window) larger than twice its standard error across windows; (2) its retrieval
at 4-8x S is above chance (the interval's lower end above it); and (3) the CE student's is not. Else the
001 claims are "inconclusive: the teacher knows no more than the student". `decide` takes the
measurements (so it is tested on made-up ones); `teacher_advantage` measures two runs and decides.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ropelab import sources
from ropelab.config import ConfigError
from ropelab.evaluate.longctx import loss_by_position, position_windows, torch_device, validation_split
from ropelab.evaluate.retrieval import RetrievalSettings, accuracy_at, passkey_retrieval
from ropelab.files import write_atomically

ADVANTAGE = "teacher has the advantage"
INCONCLUSIVE = "inconclusive: the teacher knows no more than the student"
FAR = (4, 8)  # the multiples of the short window retrieval is judged at


@dataclass
class AdvantageSettings:
    loss_windows: int = 32  # held-out windows of the teacher's length
    items: int = 20  # passkey items per (length, depth)
    multiples: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0
    batch_size: int = 8


def doubling_edges(short_window: int, length: int) -> list[int]:
    """Range edges S/2, S, 2S, 4S, ... and `length` last (positions (a, b] between edges)."""
    if not 2 <= short_window < length:
        raise ConfigError(f"teacher advantage: the short window {short_window} must be >= 2 and below the "
                          f"loss-by-position length {length}")
    edges = [short_window // 2, short_window]
    while edges[-1] * 2 < length:
        edges.append(edges[-1] * 2)
    return edges + [length]


def position_ranges(per_window: np.ndarray, short_window: int) -> list[dict]:
    """Mean loss of each doubling range of positions, overall and per window, from (W, L) token losses
    (column p is position p + 1)."""
    edges = doubling_edges(short_window, per_window.shape[1])
    return [{"start": a, "end": b, "loss": float(per_window[:, a:b].mean()),
             "per_window": per_window[:, a:b].mean(axis=1).tolist()} for a, b in zip(edges[:-1], edges[1:])]


def loss_keeps_falling(ranges: Sequence[dict]) -> tuple[bool, str]:
    """Whether the loss falls in every range after the first, and in all by more than twice its standard error."""
    means = [r["loss"] for r in ranges]
    every = all(later < earlier for earlier, later in zip(means, means[1:]))
    drops = np.asarray(ranges[0]["per_window"]) - np.asarray(ranges[-1]["per_window"])
    fall = float(drops.mean())
    se = float(drops.std(ddof=1) / math.sqrt(len(drops))) if len(drops) > 1 else math.inf
    shape = " > ".join(f"{m:.3f}" for m in means)
    text = (f"loss over positions ({ranges[0]['start']}, {ranges[0]['end']}] ... ({ranges[-1]['start']}, {ranges[-1]['end']}]: "
            f"{shape}; fall {fall:.3f} (standard error {se:.3f}, {len(drops)} windows)")
    return every and fall > 2 * se, text


def retrieval_text(pooled: Optional[dict], chance: float) -> str:
    if pooled is None:
        return "not measured"
    low, high = pooled["interval"]
    return (f"{pooled['correct']}/{pooled['n']} = {pooled['accuracy']:.2f} [{low:.2f}, {high:.2f}] at "
            f"{'-'.join(map(str, pooled['multiples']))}x the short window, chance {chance:.2f}")


def decide(teacher: dict, student: dict) -> dict:
    """The verdict on two measurements (`measure`): ADVANTAGE or INCONCLUSIVE, with the reasons."""
    falling, loss_text = loss_keeps_falling(teacher["loss_by_position"]["ranges"])
    t_far, s_far = accuracy_at(teacher["retrieval"], FAR), accuracy_at(student["retrieval"], FAR)
    teacher_retrieves = bool(t_far and t_far["above_chance"])
    student_retrieves = bool(s_far and s_far["above_chance"])
    chance = teacher["retrieval"]["chance"]
    reasons = [
        f"teacher {loss_text}: {'keeps falling' if falling else 'does not keep falling'} beyond the short window",
        f"teacher retrieval {retrieval_text(t_far, chance)}: {'above' if teacher_retrieves else 'not above'} chance",
        f"CE student retrieval {retrieval_text(s_far, chance)}: {'above' if student_retrieves else 'not above'} chance",
    ]
    advantage = falling and teacher_retrieves and not student_retrieves
    return {"verdict": ADVANTAGE if advantage else INCONCLUSIVE, "advantage": advantage, "reasons": reasons}


def accuracy_cell(row: dict) -> str:
    return f"{row['accuracy']:.2f} [{row['interval'][0]:.2f}, {row['interval'][1]:.2f}] (n={row['n']})"


def advantage_table(teacher: dict, student: dict) -> str:
    """Markdown: loss per position range and retrieval per length, teacher against the CE student."""
    lines = ["| positions | teacher loss | CE student loss |", "|---|---|---|"]
    for t, s in zip(teacher["loss_by_position"]["ranges"], student["loss_by_position"]["ranges"]):
        lines.append(f"| ({t['start']}, {t['end']}] | {t['loss']:.3f} | {s['loss']:.3f} |")
    lines += ["", "| passkey length | teacher accuracy [95% CI] | CE student accuracy [95% CI] | chance |", "|---|---|---|---|"]
    for t, s in zip(teacher["retrieval"]["lengths"], student["retrieval"]["lengths"]):
        lines.append(f"| {t['length']} ({t['multiple']}x) | {accuracy_cell(t)} | {accuracy_cell(s)} | "
                     f"{teacher['retrieval']['chance']:.2f} |")
    return "\n".join(lines)


def measure(model, tokenizer, validation, short_window: int, length: int, settings: AdvantageSettings, device: Any = "cpu") -> dict:
    """Loss by doubling position range on held-out windows of `length` tokens, and passkey retrieval."""
    windows, single = position_windows(validation, length, settings.loss_windows, settings.seed, place="inside")
    per_window = np.stack([loss_by_position(model, windows[i : i + 1], 1, device) for i in range(len(windows))])
    retrieval = RetrievalSettings(short_window, multiples=settings.multiples, items=settings.items, seed=settings.seed,
                                  batch_size=settings.batch_size)
    return {"loss_by_position": {"length": length, "windows": len(windows), "single_document_windows": single,
                                 "ranges": position_ranges(per_window, short_window)},
            "retrieval": passkey_retrieval(model, tokenizer, retrieval, device)}


def teacher_advantage(teacher_run: str, student_run: str, short_window: Optional[int] = None,
                      settings: Optional[AdvantageSettings] = None, device: Optional[str] = None) -> dict:
    """Measure the teacher and the CE student on the teacher's held-out documents and decide. The short
    window defaults to the student's `data.max_doc_len`, else its `data.seq_len`; loss by position runs
    over the teacher's `data.seq_len`."""
    settings = settings or AdvantageSettings()
    target = torch_device(device)
    teacher_config, _ = sources.load_config(teacher_run)
    student_config, _ = sources.load_config(student_run)
    short = short_window or student_config.data.max_doc_len or student_config.data.seq_len
    length = teacher_config.data.seq_len
    tokenizer, validation = validation_split(teacher_run, teacher_config)
    student = sources.load(student_run)
    if student.tokenizer.fingerprint() != tokenizer.fingerprint():
        raise ConfigError(f"{student_run}: its tokenizer ({student_config.data.tokenizer}) is not the teacher's "
                          f"({teacher_config.data.tokenizer}); the two cannot be measured on the same tokens")
    teacher_model = sources.load(teacher_run).model.to(target)
    measured = {"teacher": measure(teacher_model, tokenizer, validation, short, length, settings, target)}
    measured["student"] = measure(student.model.to(target), tokenizer, validation, short, length, settings, target)
    result = decide(measured["teacher"], measured["student"])
    return {**result, "short_window": short, "length": length, "corpus": teacher_config.data.corpus,
            "teacher": {"run": str(teacher_run), **measured["teacher"]}, "student": {"run": str(student_run), **measured["student"]},
            "table": advantage_table(measured["teacher"], measured["student"])}


def study_advantage(study: Path, teacher_run: Path, student_run: Path) -> dict:
    """`teacher_advantage` of two runs of a study, kept in ``<study>/claims/teacher-advantage.json`` and
    read from there when the claims are judged again."""
    path = Path(study) / "claims" / "teacher-advantage.json"
    if not path.is_file():
        if not (Path(teacher_run) / "result.json").is_file() or not (Path(student_run) / "result.json").is_file():
            raise ConfigError(f"teacher advantage: {teacher_run} or {student_run} has not finished training")
        found = teacher_advantage(str(teacher_run), str(student_run))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(found, indent=2))
    return json.loads(path.read_text())
