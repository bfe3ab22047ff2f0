"""The distillation seed's claims (001, "Short Data, Long Context"), judged in two settings (`Setting`):

  from scratch   ``configs/claims/distill-scratch.yaml``: a teacher trained here on long documents and
                 students from scratch on short data only; this setting decides the 001 claims, once the
                 teacher's advantage over a CE student is measured (`ropelab.claims.teacher_advantage`):
                 without it every claim is inconclusive, "the teacher knows no more than the student";
  SmolLM2        ``configs/claims/distill-smollm2.yaml``: students initialised from SmolLM2-135M with their
                 RoPE theta moved, distilled from SmolLM2 itself; a second, labelled setting that decides
                 no claim (its claims are picked by id, not by ``--only 001``).

In both, the students train in a short phase and a long phase of packed short documents, by logit KD at
the seed's three theta schedules and by CE. The probe and the weight updates run after training
(`ropelab.claims.distill_evals`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import fmean
from typing import Callable, Mapping, Sequence

from ropelab.claims.claim import Claim, Finding, from_parts
from ropelab.claims.distill_evals import (
    CAUSAL, DOC, band_means, final_val_losses, first_config, logit_kl, logit_kl_by_repeat, longctx_results, loss_curves,
    phase_lengths, probe_run, probe_shape, probe_teacher, query_change_per_pair, retrieval_by_length, retrieval_tasks,
    teacher_longctx,
)
from ropelab.claims.distill_plots import plot_loss_by_position, plot_pair_changes, plot_repeat_kl
from ropelab.claims.groups import mean_text
from ropelab.claims.study_folder import StudyFolder
from ropelab.claims.teacher_advantage import study_advantage
from ropelab.claims.verdict import INCONCLUSIVE, Verdict, absent, beats_beyond, higher, lower, present
from ropelab.study.plan import phase_counts
from ropelab.train.phases import resolve_phases

SEED = "short-data-long-context (001)"
RETRIEVAL = ("passkey", "exact_match")  # besides RULER's needle tasks, scored by RULER's `score` (%)
NO_ADVANTAGE = "the teacher knows no more than the student"


@dataclass(frozen=True)
class Setting:
    """One study of the seed's design: its variants by role, its teacher, and whether it decides."""

    study: str  # config stem under configs/claims/
    kd: str  # the seed's winning schedule (short theta -> long theta) by KD ...
    ce: str  # ... and by CE at equal tokens
    constant: tuple[str, str]  # KD with the short theta, and with the long one, through both phases
    pairs: tuple[tuple[str, str], ...]  # (KD, CE) at each schedule the study trains both at
    teacher: str  # a source name, or "@<run id>" of a teacher the study trains
    teacher_name: str  # as the tables name it
    label: str  # the setting, as the report names it
    decides: bool  # its verdicts decide the seed's claims (else: a second, labelled setting)
    gate: bool  # the teacher's advantage is measured first, against the CE student's first seed

    def teacher_source(self, study: StudyFolder) -> str:
        return str(study.path / "runs" / self.teacher[1:]) if self.teacher.startswith("@") else self.teacher


SCRATCH = Setting("distill-scratch", "kd-10k-500k", "ce-10k-500k", ("kd-10k", "kd-500k"),
                  (("kd-10k-500k", "ce-10k-500k"), ("kd-500k", "ce-500k"), ("kd-10k", "ce-10k")), "@teacher", "teacher",
                  "students from scratch on short data, distilled from a teacher trained here on long documents",
                  decides=True, gate=True)
SMOLLM2 = Setting("distill-smollm2", "kd-10k-1m", "ce-10k-1m", ("kd-10k", "kd-1m"), (("kd-10k-1m", "ce-10k-1m"),),
                  "smollm2-135m", "SmolLM2", "students that know language, distilled from their own instruct model",
                  decides=False, gate=False)
SETTINGS = (SCRATCH, SMOLLM2)


def _setup(setting: Setting, study: StudyFolder) -> str:
    """The students, where they start from, and their two phases, from the KD run's config."""
    config = first_config(study, setting.kd)
    m = config.model
    counts = phase_counts(config)
    unit = "bytes" if config.data.tokenizer == "bytes" else "tokens"
    phases = []
    for count in counts:
        c = count.phase.config
        packed = f" packed with <= {c.data.max_doc_len}-{unit[:-1]} documents" if c.data.max_doc_len else ""
        mask = ", document mask" if c.attention.doc_mask else ""
        phases.append(f"{count.phase.steps} steps of {c.train.global_batch} x {c.data.seq_len} {unit}{packed}{mask}")
    tokens = sum(count.tokens for count in counts)
    init = config.train.init_from
    start = (f"initialised from {init}" + (f" (its layers {config.train.init_layers})" if config.train.init_layers else "")
             if init else "trained from scratch")
    return (f"students of {m.n_layer} layers (d_model {m.d_model}, head_dim {m.head_size}) {start}, tokenizer "
            f"{config.data.tokenizer}, on {config.data.corpus}: {', then '.join(phases)}; {tokens:,} tokens per run, "
            f"{len(study.seed_runs(setting.kd))} seeds")


def _regime(setting: Setting, study: StudyFolder) -> str:
    """Where the students' knowledge of language comes from, and the tokens each phase adds."""
    config = first_config(study, setting.kd)
    counts = phase_counts(config)
    phases = " + ".join(f"{count.tokens:,} {count.phase.name}" for count in counts)
    start = f"initialised from {config.train.init_from}" if config.train.init_from else "from scratch"
    return f"students {start}, then {phases} tokens"


SEED_REGIME = "a 1B student from scratch: 100B short-context tokens, then 10B long-context tokens"


def theta_text(value: float) -> str:
    """10000 -> 10k, 1000000 -> 1M."""
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def _schedule(study: StudyFolder, variant: str) -> str:
    """The variant's RoPE theta per phase: "10k -> 1M", or "10k" when it stays."""
    thetas = [theta_text(p.config.model.rope.theta) for p in resolve_phases(first_config(study, variant))]
    return " -> ".join(dict.fromkeys(thetas))


def _tail_means(positions: Sequence[int], curves: Mapping[str, Sequence[Sequence[float]]], length: int) -> dict[str, list[float]]:
    """{group: each seed's mean loss over the buckets starting at `length` and beyond}."""
    beyond = [i for i, p in enumerate(positions) if p >= length]
    return {name: [fmean(curve[i] for i in beyond) for curve in lines] for name, lines in curves.items()}


def _needle_tasks(results: dict) -> list[str]:
    return [task for task in retrieval_tasks(results["settings"]) if task != RETRIEVAL[0]]


def _retrieval_beyond(study: StudyFolder, results: dict, variants: Sequence[str], length: int, task: str) -> dict[str, list[float]]:
    """{variant: each seed's mean retrieval beyond `length`}: RULER's needle score (%) averaged over the
    needle tasks (`task` "niah"), or the passkey's exact match (%)."""
    entries = {entry["label"]: entry for entry in results["runs"]}
    tasks, metric = (_needle_tasks(results), "score") if task == "niah" else ([RETRIEVAL[0]], RETRIEVAL[1])
    scale = 1.0 if metric == "score" else 100.0

    def beyond(entry: dict) -> float:
        values = [v * scale for t in tasks for n, v in retrieval_by_length(entry, t, metric).items() if n > length]
        return fmean(values) if values else math.nan

    return {v: [beyond(entries.get(run.id, {})) for run in study.seed_runs(v)] for v in variants}


def _retrieval_table(setting: Setting, study: StudyFolder, results: dict, variants: Sequence[str]) -> str:
    """The teacher's retrieval and each variant's (mean of the seeds) per task and length, as one text."""
    teacher = teacher_longctx(study, results, setting.teacher_source(study))
    entries = {entry["label"]: entry for entry in results["runs"]}
    lines = []
    for task in retrieval_tasks(results["settings"]):
        metric, scale = ("score", 1.0) if task != RETRIEVAL[0] else (RETRIEVAL[1], 100.0)
        rows = [f"{setting.teacher_name} " + ", ".join(f"{n}: {v * scale:.0f}"
                                                       for n, v in retrieval_by_length(teacher, task, metric).items())]
        for variant in variants:
            by_seed = [retrieval_by_length(entries.get(run.id, {}), task, metric) for run in study.seed_runs(variant)]
            lengths = sorted({n for found in by_seed for n in found})
            rows.append(f"{variant} " + ", ".join(
                f"{n}: {fmean(found.get(n, math.nan) for found in by_seed) * scale:.0f}" for n in lengths))
        lines.append(f"{task} ({'RULER string_match_all' if metric == 'score' else 'exact match'}, %, by prompt "
                     f"length): " + "; ".join(rows))
    return ". ".join(lines) + "."


def _needle_part(results: dict, text: str, verdict: Callable[[], Verdict]) -> list:
    """The part on RULER's needle tasks, where the study evaluates them."""
    return [(text, verdict())] if _needle_tasks(results) else []


def _judge_kd_beats_ce(setting: Setting, studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[setting.study])
    kd, ce = setting.kd, setting.ce
    length = phase_lengths(study, kd)[0]
    losses = final_val_losses(study, [kd, ce])
    results = longctx_results(study)
    paired = [v for pair in setting.pairs for v in pair]
    positions, curves = loss_curves(results, study, paired)
    needle, passkey = (_retrieval_beyond(study, results, paired, length, task) for task in ("niah", "passkey"))
    parts = [("KD below CE: final validation loss (packed short documents)", lower({kd: losses[kd]}, {ce: losses[ce]})),
             *_needle_part(results, f"KD above CE on RULER's needle tasks beyond the phase-1 length ({length})",
                           lambda: higher({kd: needle[kd]}, {ce: needle[ce]})),
             (f"KD above CE on passkey retrieval beyond {length}", higher({kd: passkey[kd]}, {ce: passkey[ce]}))]
    for a, b in setting.pairs:
        parts.append((f"KD below CE beyond {length}: loss by position, theta {_schedule(study, a)}",
                      beats_beyond({a: curves[a]}, {b: curves[b]}, positions, length)))
    config = first_config(study, kd)
    targets = f"top-{config.distill.top_k} teacher targets" if config.distill.top_k else "the teacher's full distribution"
    needle_text = f"RULER needle score beyond {length} tokens (%): {mean_text(needle, '.1f')}; " if _needle_tasks(results) else ""
    measured = (f"{_setup(setting, study)}; KD ({targets}) against CE at equal tokens, theta "
                f"{', '.join(_schedule(study, a) for a, _ in setting.pairs)}. Final validation loss (nats/token), mean "
                f"(seeds): {mean_text(losses)}. {needle_text}Passkey exact match beyond {length} (%): "
                f"{mean_text(passkey, '.1f')}. Loss by position over {_loss_length(results):,}-token windows of single "
                f"held-out {config.data.corpus} documents, mean over positions {length} and beyond: "
                f"{mean_text(_tail_means(positions, curves, length))}.")
    scope = ("The seed compares KD and CE at each of its three theta setups; here at "
             + ("each of them. " if len(setting.pairs) == 3 else "the phase-wise one only. "))
    return from_parts(measured, parts, plot_loss_by_position(positions, {v: curves[v] for v in (kd, ce)}, length),
                      "Loss by position of the KD and CE students after phase 2, one line per seed.",
                      scope + "Retrieval of the teacher and the students: "
                      + _retrieval_table(setting, study, results, dict.fromkeys([*paired, *setting.constant])),
                      _regime(setting, study))


def _judge_theta_schedule(setting: Setting, studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[setting.study])
    kd, constant = setting.kd, setting.constant
    length = phase_lengths(study, kd)[0]
    results = longctx_results(study)
    positions, curves = loss_curves(results, study, [kd, *constant])
    needle = _retrieval_beyond(study, results, [kd, *constant], length, "niah")
    passkey = _retrieval_beyond(study, results, [kd, *constant], length, "passkey")
    parts = [(f"{_schedule(study, kd)} below both constant thetas beyond {length}: loss by position",
              beats_beyond({kd: curves[kd]}, {v: curves[v] for v in constant}, positions, length)),
             *_needle_part(results, f"{_schedule(study, kd)} above both constant thetas on RULER's needle tasks beyond {length}",
                           lambda: higher({kd: needle[kd]}, {v: needle[v] for v in constant})),
             (f"{_schedule(study, kd)} above both constant thetas on passkey retrieval beyond {length}",
              higher({kd: passkey[kd]}, {v: passkey[v] for v in constant}))]
    losses = final_val_losses(study, [kd, *constant])
    constants = " and ".join(f"constant {_schedule(study, v)}" for v in constant)
    needle_text = f"RULER needle score beyond {length} tokens (%): {mean_text(needle, '.1f')}. " if _needle_tasks(results) else ""
    measured = (f"{_setup(setting, study)}; by KD, theta {_schedule(study, kd)} against {constants}. Loss by position, mean "
                f"over positions {length} and beyond: {mean_text(_tail_means(positions, curves, length))}. {needle_text}"
                f"Passkey exact match beyond {length} (%): {mean_text(passkey, '.1f')}. Final validation loss: "
                f"{mean_text(losses)}.")
    config = first_config(study, kd)
    native = ""
    if config.train.init_from == config.distill.teacher:
        theta = teacher_longctx(study, results, setting.teacher_source(study))["rope_theta"]
        native = (f" The students start from the teacher itself, trained at theta {theta_text(theta)}: "
                  f"{'no' if theta not in _thetas(setting, study) else 'not every'} setup here keeps that theta, so each must "
                  "learn positions anew, as the seed's from-scratch student does.")
    return from_parts(measured, parts, plot_loss_by_position(positions, curves, length),
                      "Loss by position of the three KD students after phase 2, one line per seed.",
                      f"The seed's thetas are 10k and 500k, its teacher's; the largest prompt here is "
                      f"{max(results['settings']['lengths']):,} tokens (the longest wavelength at theta "
                      f"{_schedule(study, constant[0])} is {_longest_wavelength(study, constant[0]):,.0f} tokens)."
                      + native, _regime(setting, study))


def _thetas(setting: Setting, study: StudyFolder) -> set[float]:
    """Every theta a KD or CE student trains at, in any phase."""
    variants = (setting.kd, setting.ce, *setting.constant)
    return {p.config.model.rope.theta for v in variants for p in resolve_phases(first_config(study, v))}


def _loss_length(results: dict) -> int:
    settings = results["settings"]
    return settings["loss_length"] or max(settings["lengths"])


def _longest_wavelength(study: StudyFolder, variant: str) -> float:
    """Tokens per turn of the slowest rotary pair of `variant` in its last phase."""
    model = resolve_phases(first_config(study, variant))[-1].config.model
    dims = model.head_size
    return 2 * math.pi * model.rope.theta ** ((dims - 2) / dims)


def _probe_folders(setting: Setting, study: StudyFolder):
    shape = probe_shape(study, setting.kd)
    return shape, [probe_run(study, run, shape) for run in study.seed_runs(setting.kd)]


def _judge_probe(setting: Setting, studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[setting.study])
    kd, name = setting.kd, setting.teacher_name
    shape, folders = _probe_folders(setting, study)
    teacher = probe_teacher(study, shape, setting.teacher_source(study))
    kl = {mode: {name: [logit_kl(teacher, 0, mode)],
                 "after short": [logit_kl(f, 0, mode) for f in folders],
                 "after long": [logit_kl(f, 1, mode) for f in folders]} for mode in (CAUSAL, DOC)}
    every = {mode: [v for values in groups.values() for v in values] for mode, groups in kl.items()}
    parts = [("reaches the logits: causal attention, running positions (teacher, both phases of each seed)",
              present(every[CAUSAL])),
             ("vanishes: document mask, positions restarting at each repeat", absent(every[DOC])),
             ("smaller after the long phase than after the short one (causal, running)",
              lower({"after long": kl[CAUSAL]["after long"]}, {"after short": kl[CAUSAL]["after short"]}))]
    block, repeats = shape
    measured = (f"One {block}-token block of {first_config(study, kd).data.corpus} validation text (BOS, content, EOS) "
                f"repeated {repeats} times ({block * repeats} tokens); mean KL (nats) of the later repeats' next-token "
                f"distributions at their last token to the first repeat's. The {name} and the {kd} students at the end "
                f"of each phase ({_setup(setting, study)}). Causal, running positions: {mean_text(kl[CAUSAL], '.3g')}. "
                f"Document mask, restarting positions: {mean_text(kl[DOC], '.3g')}.")
    lines = {name: logit_kl_by_repeat(teacher, 0, CAUSAL)}
    for seed, folder in enumerate(folders):
        if folder is not None:
            lines |= {f"{kd} s{seed} after short": logit_kl_by_repeat(folder, 0, CAUSAL),
                      f"{kd} s{seed} after long": logit_kl_by_repeat(folder, 1, CAUSAL)}
    return from_parts(measured, parts, plot_repeat_kl(lines, block),
                      "KL of each repeat to the first under causal attention with running positions (with a document "
                      "mask and restarting positions every repeat is identical: 0).",
                      "The seed probes its 1B student over 64 repeats of 2,048 tokens and records every stage; here the "
                      "logits only, over the phase-2 window.", _regime(setting, study))


def _judge_query_band(setting: Setting, studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[setting.study])
    _, folders = _probe_folders(setting, study)
    config = first_config(study, setting.kd)
    pairs = config.model.head_size // 2
    cut = [round(i * pairs / 3) for i in range(4)]
    bands = {f"{name} frequency": range(cut[i], cut[i + 1]) for i, name in enumerate(("high", "mid", "low"))}
    per_seed = [query_change_per_pair(folder, pairs) for folder in folders]
    means = [band_means(changes, bands) for changes in per_seed]
    groups = {name: [m[name] for m in means] for name in bands}
    verdict = higher({"mid frequency": groups["mid frequency"]},
                     {name: groups[name] for name in ("high frequency", "low frequency")})
    theta = resolve_phases(config)[-1].config.model.rope.theta
    edges = ", ".join(f"pair {b.start}: {2 * math.pi * theta ** (2 * b.start / (2 * pairs)):,.0f}" for b in bands.values())
    measured = (f"Relative change ||W_q(phase 2) - W_q(phase 1)|| / ||W_q(phase 1)|| per rotary pair (rows of all heads, "
                f"averaged over the {config.model.n_layer} layers) of the {setting.kd} students ({_setup(setting, study)}); "
                f"pairs split in thirds by frequency (wavelengths in tokens at the phase-2 theta {theta:,.0f}: {edges}). "
                f"Mean change per band: {mean_text(groups, '.4f')}.")
    return from_parts(measured, [("mid-frequency pairs change more than high and low ones", verdict)],
                      plot_pair_changes(per_seed, bands),
                      "Relative change of the query weights per rotary pair during phase 2, one line per seed.",
                      "The seed reads the update pattern off its 1B student's query states over 10B phase-2 tokens; "
                      f"here the weights themselves after {phase_counts(config)[-1].tokens:,} phase-2 tokens.",
                      _regime(setting, study))


def _judged(setting: Setting, judge: Callable[[Setting, Mapping[str, Path]], Finding],
            studies: Mapping[str, Path]) -> Finding:
    """`judge` in `setting`: behind the teacher's advantage where the setting has the gate (without it the
    claim is inconclusive, "the teacher knows no more than the student"), labelled where it decides nothing."""
    label = f"Setting: {setting.label}" + ("" if setting.decides else " (a second setting: it decides no claim)") + ". "
    if not setting.gate:
        finding = judge(setting, studies)
        return dataclasses.replace(finding, note=label + finding.note)
    study = StudyFolder(studies[setting.study])
    found = study_advantage(study.path, Path(setting.teacher_source(study)), study.seed_runs(setting.ce)[0].path)
    advantage = (f"The teacher's advantage, measured first ({found['corpus']}, short window {found['short_window']}, "
                 f"loss by position over {found['length']}): {'; '.join(found['reasons'])}.")
    finding = judge(setting, studies)
    if not found["advantage"]:  # measured all the same, so that the figures are there to read, but not a verdict
        return dataclasses.replace(
            finding, verdict=Verdict(INCONCLUSIVE, f"{NO_ADVANTAGE}: {'; '.join(found['reasons'])}"),
            measured=(f"{advantage} Measured all the same, not a verdict (with a teacher that had the advantage it "
                      f"would read \"{finding.verdict.outcome}\"): {finding.measured}"),
            table=finding.table or _advantage_rows(found), note=label + finding.note)
    return dataclasses.replace(finding, measured=f"{advantage} {finding.measured}", note=label + finding.note)


def _advantage_rows(found: dict) -> tuple[list[str], list[list[str]]]:
    """The teacher's advantage as the finding's table: loss per position range, then passkey per length."""
    teacher, student = found["teacher"], found["student"]
    rows = [[f"loss, positions ({t['start']}, {t['end']}]", f"{t['loss']:.3f}", f"{s['loss']:.3f}"]
            for t, s in zip(teacher["loss_by_position"]["ranges"], student["loss_by_position"]["ranges"])]
    rows += [[f"passkey at {t['length']} ({t['multiple']}x)", f"{t['accuracy']:.2f} [{t['interval'][0]:.2f}, {t['interval'][1]:.2f}]",
              f"{s['accuracy']:.2f} [{s['interval'][0]:.2f}, {s['interval'][1]:.2f}]"]
             for t, s in zip(teacher["retrieval"]["lengths"], student["retrieval"]["lengths"])]
    return ["measure", "teacher", "CE student"], rows


_STATEMENTS = (
    ("kd-beats-ce", "Sec. 3, Finding 2 (Figs. 4-5)",
     "Logit KD from a long-context teacher beats cross-entropy at equal tokens: a lower loss on the short "
     "training documents and a better long context, beyond the phase-1 length.", _judge_kd_beats_ce),
    ("theta-schedule", "Sec. 3, Finding 1 (Figs. 3-5)",
     "RoPE theta 10k in the short phase and 500k in the long one beats a constant 10k and a constant 500k "
     "on long context.", _judge_theta_schedule),
    ("probe-perturbation", "Sec. 4-5 (Fig. 6, App. A)",
     "A block repeated across the window perturbs the output logits through RoPE under causal attention with "
     "running positions, not with a document mask and restarting positions, and less after the long phase "
     "than after the short one.", _judge_probe),
    ("query-weights-band", "Sec. 5 (query-state updates, the abstract's third finding)",
     "During the long phase the query weights change most in a band of mid-frequency rotary pairs.", _judge_query_band),
)


def setting_claims(setting: Setting) -> list[Claim]:
    """The seed's four claims judged in `setting`; a setting that decides nothing gets ids of its own
    (``smollm2-kd-beats-ce``) and statements that name it."""
    prefix = "" if setting.decides else f"{setting.study.removeprefix('distill-')}-"
    lead = "" if setting.decides else f"[{setting.label}; decides no claim] "
    return [Claim(prefix + name, SEED, section, lead + statement, (setting.study,), partial(_judged, setting, judge),
                  SEED_REGIME, decides=setting.decides)
            for name, section, statement, judge in _STATEMENTS]


DISTILL_CLAIMS: list[Claim] = [claim for setting in SETTINGS for claim in setting_claims(setting)]
