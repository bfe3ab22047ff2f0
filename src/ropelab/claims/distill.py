"""The distillation seed's claims (001, "Short Data, Long Context"), judged on the study shipped as
``configs/claims/distill-smollm2.yaml``: students initialised from SmolLM2-135M with their RoPE theta
moved off the one they were trained at, trained in a short phase and a long phase of packed short
documents, by logit KD from SmolLM2 at three theta schedules and by CE at one. The probe and the weight
updates run after training (`ropelab.claims.distill_evals`).
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean
from typing import Mapping, Sequence

from ropelab.claims.claim import Claim, Finding, from_parts
from ropelab.claims.distill_evals import (
    CAUSAL, DOC, band_means, final_val_losses, first_config, logit_kl, logit_kl_by_repeat, longctx_results, loss_curves,
    phase_lengths, probe_run, probe_shape, probe_teacher, query_change_per_pair, retrieval_by_length, retrieval_tasks,
    teacher_longctx,
)
from ropelab.claims.distill_plots import plot_loss_by_position, plot_pair_changes, plot_repeat_kl
from ropelab.claims.groups import mean_text
from ropelab.claims.study_folder import StudyFolder
from ropelab.claims.verdict import absent, beats_beyond, higher, lower, present
from ropelab.study.plan import phase_counts
from ropelab.train.phases import resolve_phases

SEED = "short-data-long-context (001)"
STUDY = "distill-smollm2"
KD, CE = "kd-10k-1m", "ce-10k-1m"  # the seed's winning schedule (short theta -> long theta), by KD and by CE
CONSTANT = ("kd-10k", "kd-1m")  # the same thetas held constant through both phases
RETRIEVAL = ("passkey", "exact_match")  # besides RULER's needle tasks, scored by RULER's `score` (%)


def _setup(study: StudyFolder) -> str:
    """The students, where they start from, and their two phases, from the KD run's config."""
    config = first_config(study, KD)
    m = config.model
    counts = phase_counts(config)
    phases = []
    for count in counts:
        c = count.phase.config
        packed = f" packed with <= {c.data.max_doc_len}-token documents" if c.data.max_doc_len else ""
        mask = ", document mask" if c.attention.doc_mask else ""
        phases.append(f"{count.phase.steps} steps of {c.train.global_batch} x {c.data.seq_len} tokens{packed}{mask}")
    tokens = sum(count.tokens for count in counts)
    init = config.train.init_from
    start = (f"initialised from {init}" + (f" (its layers {config.train.init_layers})" if config.train.init_layers else "")
             if init else "trained from scratch")
    return (f"students of {m.n_layer} layers (d_model {m.d_model}, head_dim {m.head_size}) {start}, sharing "
            f"SmolLM2-135M's tokenizer, on {config.data.corpus}: {', then '.join(phases)}; {tokens:,} tokens per run, "
            f"{len(study.seed_runs(KD))} seeds")


def _regime(study: StudyFolder) -> str:
    """Where the students' knowledge of language comes from, and the tokens each phase adds."""
    config = first_config(study, KD)
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


def _retrieval_table(study: StudyFolder, results: dict, variants: Sequence[str]) -> str:
    """The teacher's retrieval and each variant's (mean of the seeds) per task and length, as one text."""
    teacher = teacher_longctx(study, results)
    entries = {entry["label"]: entry for entry in results["runs"]}
    lines = []
    for task in retrieval_tasks(results["settings"]):
        metric, scale = ("score", 1.0) if task != RETRIEVAL[0] else (RETRIEVAL[1], 100.0)
        rows = [f"SmolLM2 " + ", ".join(f"{n}: {v * scale:.0f}" for n, v in retrieval_by_length(teacher, task, metric).items())]
        for variant in variants:
            by_seed = [retrieval_by_length(entries.get(run.id, {}), task, metric) for run in study.seed_runs(variant)]
            lengths = sorted({n for found in by_seed for n in found})
            rows.append(f"{variant} " + ", ".join(
                f"{n}: {fmean(found.get(n, math.nan) for found in by_seed) * scale:.0f}" for n in lengths))
        lines.append(f"{task} ({'RULER string_match_all' if metric == 'score' else 'exact match'}, %, by prompt "
                     f"length): " + "; ".join(rows))
    return ". ".join(lines) + "."


def _judge_kd_beats_ce(studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[STUDY])
    length = phase_lengths(study, KD)[0]
    losses = final_val_losses(study, [KD, CE])
    results = longctx_results(study)
    positions, curves = loss_curves(results, study, [KD, CE])
    needle, passkey = (_retrieval_beyond(study, results, [KD, CE], length, task) for task in ("niah", "passkey"))
    parts = [("KD below CE: final validation loss (packed short documents)", lower({KD: losses[KD]}, {CE: losses[CE]})),
             (f"KD above CE on RULER's needle tasks beyond the phase-1 length ({length})",
              higher({KD: needle[KD]}, {CE: needle[CE]})),
             (f"KD above CE on passkey retrieval beyond {length}", higher({KD: passkey[KD]}, {CE: passkey[CE]})),
             (f"KD below CE beyond {length}: loss by position",
              beats_beyond({KD: curves[KD]}, {CE: curves[CE]}, positions, length))]
    config = first_config(study, KD)
    measured = (f"{_setup(study)}; theta {_schedule(study, KD)}, KD (top-{config.distill.top_k} teacher targets) against "
                f"CE at equal tokens. Final validation loss (nats/token), mean (seeds): {mean_text(losses)}. RULER needle "
                f"score beyond {length} tokens (%): {mean_text(needle, '.1f')}; passkey exact match (%): "
                f"{mean_text(passkey, '.1f')}. Loss by position over {_loss_length(results):,}-token windows of single "
                f"{config.data.corpus} files, mean over positions {length} and beyond: "
                f"{mean_text(_tail_means(positions, curves, length))}.")
    return from_parts(measured, parts, plot_loss_by_position(positions, curves, length),
                      "Loss by position of the KD and CE students after phase 2, one line per seed.",
                      "The seed compares KD and CE at each of its three theta setups; here at the phase-wise one only. "
                      "Retrieval of the teacher and the students: " + _retrieval_table(study, results, [KD, CE, *CONSTANT]),
                      _regime(study))


def _judge_theta_schedule(studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[STUDY])
    length = phase_lengths(study, KD)[0]
    results = longctx_results(study)
    positions, curves = loss_curves(results, study, [KD, *CONSTANT])
    needle = _retrieval_beyond(study, results, [KD, *CONSTANT], length, "niah")
    parts = [(f"{_schedule(study, KD)} below both constant thetas beyond {length}: loss by position",
              beats_beyond({KD: curves[KD]}, {v: curves[v] for v in CONSTANT}, positions, length)),
             (f"{_schedule(study, KD)} above both constant thetas on RULER's needle tasks beyond {length}",
              higher({KD: needle[KD]}, {v: needle[v] for v in CONSTANT}))]
    losses = final_val_losses(study, [KD, *CONSTANT])
    constants = " and ".join(f"constant {_schedule(study, v)}" for v in CONSTANT)
    measured = (f"{_setup(study)}; by KD, theta {_schedule(study, KD)} against {constants}. Loss by position, mean over "
                f"positions {length} and beyond: {mean_text(_tail_means(positions, curves, length))}. RULER needle score "
                f"beyond {length} tokens (%): {mean_text(needle, '.1f')}. Final validation loss: {mean_text(losses)}.")
    config = first_config(study, KD)
    native = ""
    if config.train.init_from == config.distill.teacher:
        theta = teacher_longctx(study, results)["rope_theta"]
        native = (f" The students start from the teacher itself, trained at theta {theta_text(theta)}: "
                  f"{'no' if theta not in _thetas(study) else 'not every'} setup here keeps that theta, so each must "
                  "learn positions anew, as the seed's from-scratch student does.")
    return from_parts(measured, parts, plot_loss_by_position(positions, curves, length),
                      "Loss by position of the three KD students after phase 2, one line per seed.",
                      f"The seed's thetas are 10k and 500k, its teacher's; the largest prompt here is "
                      f"{max(results['settings']['lengths']):,} tokens (the longest wavelength at theta "
                      f"{_schedule(study, CONSTANT[0])} is {_longest_wavelength(study, CONSTANT[0]):,.0f} tokens)."
                      + native, _regime(study))


def _thetas(study: StudyFolder) -> set[float]:
    """Every theta a KD or CE student trains at, in any phase."""
    return {p.config.model.rope.theta for v in (KD, CE, *CONSTANT) for p in resolve_phases(first_config(study, v))}


def _loss_length(results: dict) -> int:
    settings = results["settings"]
    return settings["loss_length"] or max(settings["lengths"])


def _longest_wavelength(study: StudyFolder, variant: str) -> float:
    """Tokens per turn of the slowest rotary pair of `variant` in its last phase."""
    model = resolve_phases(first_config(study, variant))[-1].config.model
    dims = model.head_size
    return 2 * math.pi * model.rope.theta ** ((dims - 2) / dims)


def _probe_folders(study: StudyFolder):
    shape = probe_shape(study, KD)
    return shape, [probe_run(study, run, shape) for run in study.seed_runs(KD)]


def _judge_probe(studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[STUDY])
    shape, folders = _probe_folders(study)
    teacher = probe_teacher(study, shape)
    kl = {mode: {"teacher": [logit_kl(teacher, 0, mode)],
                 "after short": [logit_kl(f, 0, mode) for f in folders],
                 "after long": [logit_kl(f, 1, mode) for f in folders]} for mode in (CAUSAL, DOC)}
    every = {mode: [v for values in groups.values() for v in values] for mode, groups in kl.items()}
    parts = [("reaches the logits: causal attention, running positions (teacher, both phases of each seed)",
              present(every[CAUSAL])),
             ("vanishes: document mask, positions restarting at each repeat", absent(every[DOC])),
             ("smaller after the long phase than after the short one (causal, running)",
              lower({"after long": kl[CAUSAL]["after long"]}, {"after short": kl[CAUSAL]["after short"]}))]
    block, repeats = shape
    measured = (f"One {block}-token block of {first_config(study, KD).data.corpus} validation text (BOS, content, EOS) "
                f"repeated {repeats} times ({block * repeats} tokens); mean KL (nats) of the later repeats' next-token "
                f"distributions at their last token to the first repeat's. SmolLM2 and the {KD} students at the end of "
                f"each phase ({_setup(study)}). Causal, running positions: {mean_text(kl[CAUSAL], '.3g')}. Document mask, "
                f"restarting positions: {mean_text(kl[DOC], '.3g')}.")
    lines = {"SmolLM2": logit_kl_by_repeat(teacher, 0, CAUSAL)}
    for seed, folder in enumerate(folders):
        if folder is not None:
            lines |= {f"{KD} s{seed} after short": logit_kl_by_repeat(folder, 0, CAUSAL),
                      f"{KD} s{seed} after long": logit_kl_by_repeat(folder, 1, CAUSAL)}
    return from_parts(measured, parts, plot_repeat_kl(lines, block),
                    "KL of each repeat to the first under causal attention with running positions (with a document "
                    "mask and restarting positions every repeat is identical: 0).",
                    "The seed probes its 1B student over 64 repeats of 2,048 tokens and records every stage; here the "
                    "logits only, over the phase-2 window.", _regime(study))


def _judge_query_band(studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[STUDY])
    _, folders = _probe_folders(study)
    config = first_config(study, KD)
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
                f"averaged over the {config.model.n_layer} layers) of the {KD} students ({_setup(study)}); pairs split "
                f"in thirds by frequency (wavelengths in tokens at the phase-2 theta {theta:,.0f}: {edges}). Mean change "
                f"per band: {mean_text(groups, '.4f')}.")
    return from_parts(measured, [("mid-frequency pairs change more than high and low ones", verdict)],
                    plot_pair_changes(per_seed, bands),
                    "Relative change of the query weights per rotary pair during phase 2, one line per seed.",
                    "The seed reads the update pattern off its 1B student's query states over 10B phase-2 tokens; "
                    f"here the weights themselves after {phase_counts(config)[-1].tokens:,} phase-2 tokens.", _regime(study))


DISTILL_CLAIMS: list[Claim] = [
    Claim("kd-beats-ce", SEED, "Sec. 3, Finding 2 (Figs. 4-5)",
          "Logit KD from a long-context teacher beats cross-entropy at equal tokens: a lower loss on the short "
          "training documents and a better long context, beyond the phase-1 length.",
          (STUDY,), _judge_kd_beats_ce, SEED_REGIME),
    Claim("theta-schedule", SEED, "Sec. 3, Finding 1 (Figs. 3-5)",
          "RoPE theta 10k in the short phase and 500k in the long one beats a constant 10k and a constant 500k "
          "on long context.",
          (STUDY,), _judge_theta_schedule, SEED_REGIME),
    Claim("probe-perturbation", SEED, "Sec. 4-5 (Fig. 6, App. A)",
          "A block repeated across the window perturbs the output logits through RoPE under causal attention with "
          "running positions, not with a document mask and restarting positions, and less after the long phase "
          "than after the short one.",
          (STUDY,), _judge_probe, SEED_REGIME),
    Claim("query-weights-band", SEED, "Sec. 5 (query-state updates, the abstract's third finding)",
          "During the long phase the query weights change most in a band of mid-frequency rotary pairs.",
          (STUDY,), _judge_query_band, SEED_REGIME),
]
