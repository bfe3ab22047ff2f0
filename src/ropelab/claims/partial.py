"""The partial-RoPE seed's claims (000: RQ1-RQ6 and the NoPE spikes), each judged on studies shipped
under ``configs/claims/partial-*.yaml``.

RQ1 and RQ3-RQ5 train on byte-level English prose (`wiki-prose`, Wikipedia lead sections), as the seed
trained on English web text (FineWeb); RQ2 adds a second English corpus of another quality; RQ6's local
tasks are Python, so it reads the same grid trained on standard-library source (`partial-scaling-code`).
RQ1-RQ5 are judged on loss frontiers (`ropelab.study.frontier`): each variant's final validation loss
at token budgets up to 20 tokens per non-embedding parameter, two seeds, with the frontier rule of
`ropelab.claims.verdict` (the gap at the largest budget against the seed noise, and its trend with
tokens). "Fraction" is the nominal one of the variant's name (rope10 = 10 %); with head_dim 64 the
rotated dims are 2 * floor(f * 32): 0, 2, 6, 16 and 64 for NoPE, 2ch, 10 %, 25 % and 100 %.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import Mapping, Sequence

from ropelab.claims.claim import Claim, Finding, Parts, from_parts
from ropelab.claims.frontiers import (
    band_parts, final_losses, frontier_text, plot_frontiers, regime, runs_regime, size_frontiers, still_falling_note,
)
from ropelab.claims.groups import finish_axes, mean_text, pick, seed_groups
from ropelab.claims.paths import EVAL_TASKS, REPO_ROOT
from ropelab.claims.study_folder import StudyFolder, variant_of
from ropelab.claims.verdict import higher, lower, matches, present, rises_sharply
from ropelab.config import ConfigError
from ropelab.evaluate.lm_eval import evaluate_lm
from ropelab.study.bootstrap import DEFAULT_RESAMPLES
from ropelab.study.fit import MIN_SIZES, Point
from ropelab.study.frontier_report import fit_points
from ropelab.study.plots import new_figure, png_bytes
from ropelab.study.variant_fits import fit_variants, joint_gap

SEED = "partial-rope (000)"
# The seed's runs: 1B models on 100B tokens (about 100 per non-embedding parameter), 8B on 100B (12.5)
SEED_REGIME = "12.5 (8B) to about 100 (1B) tokens per non-embedding parameter, 100B tokens"
SEED_SIZES = {"1B": 1e9, "8B": 8e9}  # taken as non-embedding parameters
SEED_TOKENS = 100e9
RQ6_TASKS = ("lambada_stdlib", "nextline_stdlib", "python_mc")  # local tasks under configs/eval
FRACTIONS = ("nope", "2ch", "rope10", "rope25", "rope100")
RQ1_BANDS = (("nope", "2ch"), ("rope10", "rope25", "rope100"))
THREE = ("nope", "rope10", "rope100")
NOMINAL_FRACTION = {"nope": 0.0, "2ch": 2 / 64, "rope10": 0.1, "rope25": 0.25, "rope100": 1.0}
SCALING = "partial-scaling"
SCALING_CODE = "partial-scaling-code"
ENGLISH = "byte-level English prose (wiki-prose: Wikipedia lead sections, 4.9M bytes)"
FRONTIER_RULE_NOTE = ("Each verdict compares frontiers: the gap between two variants' final losses at the largest budget "
                      "against k x the seed noise there, and the gap's slope per doubling of tokens (see the rule).")


def _frontier_bands(stem: str, bands: Sequence[Sequence[str]], what: str, note: str = ""):
    """A judge: the seed's bands on every model size of the study's frontiers."""
    def judge(studies: Mapping[str, Path]) -> Finding:
        study = StudyFolder(studies[stem])
        by_size = size_frontiers(study, [name for band in bands for name in band])
        parts: Parts = [part for params, frontiers in by_size.items()
                        for part in band_parts(frontiers, bands, f"{params:,} parameters", "rope100")]
        measured = f"{what}. Final validation loss, smallest -> largest budget, mean over seeds: {frontier_text(by_size)}."
        return from_parts(measured, parts, plot_frontiers(by_size, "rope100"),
                          "Final loss against tokens per model size (points: seeds; lines: L(D) = E + B D^-beta fitted), "
                          "and each variant's gap to full RoPE against tokens.", " ".join([FRONTIER_RULE_NOTE, note]).strip(),
                          regime(study))
    return judge


def seed_scale_gap(points: Sequence[Point], resamples: int = DEFAULT_RESAMPLES) -> str:
    """One sentence: the 10 %-vs-100 % gap (rope10 - rope100) that both variants' joint laws L(N, D)
    predict at the seed's sizes on its tokens, with a 95 % bootstrap interval over the paired resamples,
    only when both laws' alpha is identified by its profile (`ropelab.study.fit_profiles`); else why not,
    naming the variant."""
    points = [p for p in points if p.variant in ("rope10", "rope100")]
    sizes = {v: len({p.params for p in points if p.variant == v}) for v in ("rope10", "rope100")}
    short = [v for v, n in sizes.items() if n < MIN_SIZES]
    not_extrapolated = "The 10 %-vs-100 % gap is not extrapolated to the seed's 1B and 8B models"
    if short:
        return (f"{not_extrapolated}: {short[0]} has {sizes[short[0]]} model size(s), and a joint law L(N, D), "
                f"whose alpha carries the gap across sizes, needs {MIN_SIZES}.")
    fits = fit_variants(points, resamples=resamples)
    unidentified = [fit for fit in fits if not fit.identified("alpha")]
    if unidentified:
        return (f"{not_extrapolated}: the data do not identify alpha in the joint law L(N, D) of "
                + " or ".join(f"{fit.variant} (profile interval {fit.joint_profiles['alpha'].interval_text})"
                              for fit in unidentified) + ".")
    largest = max(p.params for p in points)
    predicted = "; ".join(f"{name}: {joint_gap(fits, 'rope10', 'rope100', params, SEED_TOKENS)} nats"
                          f" ({params / largest:,.0f}x the largest size measured)" for name, params in SEED_SIZES.items())
    alphas = ", ".join(f"{fit.variant} {fit.joint_profiles['alpha'].interval_text}" for fit in fits)
    return (f"Extrapolated by each variant's joint law L(N, D) (alpha identified: profile intervals {alphas}), the "
            f"10 %-vs-100 % gap at {SEED_TOKENS:.3g} tokens [95 % bootstrap interval] is {predicted}; a law fitted "
            "at tiny scale carried this far is a guide, not a measurement.")


def _judge_rq1(studies: Mapping[str, Path]) -> Finding:
    finding = _frontier_bands(SCALING, RQ1_BANDS, f"1-3 layers of d_model 32 and of d_model 64 (one head of 64 "
                              f"channels) on {ENGLISH}, 256 bytes per window")(studies)
    extrapolation = seed_scale_gap(fit_points(StudyFolder(studies[SCALING]).frontier_points))
    return dataclasses.replace(finding, note=f"{finding.note} {extrapolation}".strip())


def _gap_at_final(frontiers, a: str, b: str, absolute: bool = False) -> list[float]:
    final = final_losses(frontiers)
    return [abs(x - y) if absolute else x - y for x, y in zip(final[a], final[b])]


def _scaling_at_size_of(studies: Mapping[str, Path], other: str) -> dict:
    """partial-scaling's frontiers of NoPE, 10 % and full RoPE at the model size of study `other`."""
    by_size = size_frontiers(StudyFolder(studies[SCALING]), list(THREE))
    same_size = next(iter(StudyFolder(studies[other]).frontier.values())).params
    if same_size not in by_size:
        raise ConfigError(f"{SCALING} has no model of {other}'s size ({same_size:,} parameters)")
    return by_size[same_size]


def _judge_rq2(studies: Mapping[str, Path]) -> Finding:
    prose = StudyFolder(studies["partial-prose"])
    (docstrings,) = size_frontiers(prose, list(THREE)).values()
    corpora = {"wiki-prose": _scaling_at_size_of(studies, "partial-prose"), "stdlib-prose": docstrings}
    parts: Parts = [part for corpus, frontiers in corpora.items()
                    for part in band_parts(frontiers, [["nope"], ["rope10", "rope100"]], corpus, "rope100")]
    measured = ("The 2-layer model of partial-scaling (d_model 64, one head of 64) on two English corpora of different "
                "quality, byte-level: wiki-prose (edited encyclopedia prose, standing in for FineWeb-Edu) and "
                "stdlib-prose (the standard library's docstrings and comments: terse, technical and fragmentary, "
                "standing in for the unfiltered FineWeb). Final validation loss, smallest -> largest budget: "
                f"{frontier_text(corpora)}.")
    return from_parts(measured, parts, plot_frontiers(corpora, "rope100"),
                      "Final loss against tokens on each corpus, and the gaps to full RoPE.",
                      FRONTIER_RULE_NOTE + " The seed's pair is FineWeb against FineWeb-Edu (the same web text, filtered "
                      "for educational value); no such pair installs offline, so the pair here differs in quality and also "
                      "in register. Losses on the two corpora are not comparable with each other (different text); "
                      "the claim is about the bands within each.", regime(prose))


def _judge_rq3(studies: Mapping[str, Path]) -> Finding:
    by_length = StudyFolder(studies["partial-lengths"])
    lengths = {}
    for length in (128, 512):
        (frontiers,) = size_frontiers(by_length, [f"{v}-len{length}" for v in THREE]).values()
        lengths[length] = {name.removesuffix(f"-len{length}"): f for name, f in frontiers.items()}
    lengths[256] = _scaling_at_size_of(studies, "partial-lengths")
    lengths = dict(sorted(lengths.items()))
    parts: Parts = [part for length, frontiers in lengths.items()
                    for part in band_parts(frontiers, [["nope"], ["rope10", "rope100"]], f"{length} tokens", "rope100")]
    drift = {length: _gap_at_final(frontiers, "rope10", "rope100") for length, frontiers in lengths.items()}
    parts.append(("10 % drifts up from full RoPE as the length grows (gap at the largest budget, 512 against 128)",
                  higher({"10 % gap at 512": drift[512]}, {"10 % gap at 128": drift[128]})))
    measured = ("The 2-layer model of partial-scaling (d_model 64, one head of 64) at 128, 256 and 512 bytes per window, "
                f"equal tokens per step, {ENGLISH}. Final validation loss, smallest -> largest budget: "
                + frontier_text({f"{length} tokens": f for length, f in lengths.items()})
                + ". Gap of 10 % above full RoPE at the largest budget per seed: "
                + "; ".join(f"{length}: {', '.join(f'{d:+.4f}' for d in ds)}" for length, ds in drift.items()) + ".")
    figure = plot_frontiers({f"{length} tokens per window": f for length, f in lengths.items()}, "rope100")
    return from_parts(measured, parts, figure, "Final loss against tokens at each training length, and the gaps to full RoPE.",
                      FRONTIER_RULE_NOTE + " The seed's lengths are 1,024-8,192 tokens; here 128-512. Full RoPE stands for "
                      "the seed's >= 25 % band.", regime(by_length))


def _judge_rq5(studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[SCALING])
    by_size = size_frontiers(study, list(THREE))
    small, large = min(by_size), max(by_size)
    spread = {params: _gap_at_final(by_size[params], "rope10", "rope100", absolute=True) for params in (small, large)}
    parts = band_parts(by_size[large], [["nope"], ["rope10", "rope100"]], f"{large:,} parameters", "rope100")
    parts.append((f"the RoPE variants more spread at {large:,} than at {small:,} parameters (|10 % - 100 %| at the "
                  "largest budget, per seed)",
                  higher({f"|10 % - 100 %| at {large:,}": spread[large]}, {f"|10 % - 100 %| at {small:,}": spread[small]})))
    measured = (f"The {len(by_size)} sizes of partial-scaling ({', '.join(f'{p:,}' for p in sorted(by_size))} non-embedding "
                f"parameters), {ENGLISH}. Final loss, smallest -> largest budget: "
                f"{frontier_text(by_size)}. |10 % - 100 %| per seed at the largest budget: "
                + "; ".join(f"{params:,}: {', '.join(f'{v:.4f}' for v in values)}" for params, values in spread.items()) + ".")
    return from_parts(measured, parts, plot_frontiers(by_size, "rope100"),
                      "Final loss against tokens per model size, and the gaps to full RoPE.",
                      FRONTIER_RULE_NOTE + f" The seed scales 1B to 8B parameters; here {small / 1e3:.0f}k to "
                      f"{large / 1e3:.0f}k.", regime(study))


def _final_runs(study: StudyFolder) -> list[str]:
    """The finished cooldown runs of the largest size at the largest budget: the models RQ6 evaluates."""
    record = {run_id: run for run_id, run in study.frontier.items() if run.role == "cooldown"}
    largest = max(run.params for run in record.values())
    budget = max(run.budget for run in record.values() if run.params == largest)
    finished = {run.id: run.path for run in study.runs if run.result is not None}
    return sorted(str(finished[run_id]) for run_id, run in record.items()
                  if run.params == largest and run.budget == budget and run_id in finished)


def lm_eval_results(study: StudyFolder) -> dict:
    """`RQ6_TASKS` on the largest model at the largest budget (every fraction and seed), run once and
    kept in ``<study>/claims/lm_eval/results.json``."""
    folder = study.path / "claims" / "lm_eval"
    runs = _final_runs(study)
    cached = folder / "results.json"
    if cached.is_file():
        results = json.loads(cached.read_text())
        if sorted(entry["run"] for entry in results["runs"]) == runs and set(results["tasks"]) == set(RQ6_TASKS):
            return results
    with contextlib.chdir(REPO_ROOT):  # the task YAMLs name their data files relative to the repository
        return evaluate_lm(runs, tasks=list(RQ6_TASKS), out_dir=folder.resolve(), include_path=EVAL_TASKS,
                           bootstrap_iters=0)


def _by_fraction(results: dict, task: str, metric: str) -> dict[float, list[float]]:
    out: dict[float, list[float]] = {}
    for entry in results["runs"]:
        variant = Path(entry["run"]).name.split("-")[0]
        value = entry["metrics"].get(task, {}).get(metric, [None])[0]
        out.setdefault(NOMINAL_FRACTION[variant], []).append(float("nan") if value is None else value)
    return dict(sorted(out.items()))


def _plot_rq6(panels: Mapping[str, Mapping[float, list[float]]]) -> bytes:
    fig = new_figure(4.5 * len(panels), 3.4)
    for index, (label, data) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), index + 1)
        xs = ["2ch" if f == NOMINAL_FRACTION["2ch"] else f"{f:.0%}" for f in data]
        for seed in range(max(len(v) for v in data.values())):
            ax.plot(xs, [v[seed] if seed < len(v) else float("nan") for v in data.values()], "o-", ms=4, label=f"seed {seed}")
        finish_axes(ax, "rotated fraction", label, log_y=index == 0)
    return png_bytes(fig)


def _judge_rq6(studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies[SCALING_CODE])
    results = lm_eval_results(study)
    ppl = _by_fraction(results, "lambada_stdlib", "perplexity")
    nextline = _by_fraction(results, "nextline_stdlib", "acc_norm")
    quiz = _by_fraction(results, "python_mc", "acc_norm")
    label = {f: name for name, f in NOMINAL_FRACTION.items()}
    # judged on log perplexity (nats per word), the scale of the seed's Fig. 5: on raw perplexity the seed range of
    # the highest group (1e9 against 5e8) swamps a thousandfold drop
    log_ppl = {f: [math.log(v) for v in values] for f, values in ppl.items()}
    parts = [("lambada_stdlib log perplexity drops sharply from < 10 % to >= 10 %",
              rises_sharply(log_ppl, 0.1, higher_is_better=False)),
             ("nextline_stdlib accuracy flat across fractions", matches({label[f]: v for f, v in nextline.items()})),
             ("python_mc accuracy flat across fractions", matches({label[f]: v for f, v in quiz.items()}))]
    measured = (f"lm-evaluation-harness, zero-shot, on the {len(results['runs'])} runs of partial-scaling-code's largest model "
                "(trained on byte-level standard-library source, as the tasks are Python) at its largest budget (every fraction, both seeds). lambada_stdlib (300 items: the last "
                "identifier of a stdlib validation passage that only its context gives away) perplexity: "
                f"{mean_text({label[f]: v for f, v in ppl.items()}, '.3g')}. nextline_stdlib (300 items: the next line of a "
                "validation passage among 4, acc_norm; chance 0.25): "
                f"{mean_text({label[f]: v for f, v in nextline.items()})}. python_mc (8 questions about Python, acc_norm): "
                f"{mean_text({label[f]: v for f, v in quiz.items()})}.")
    figure = _plot_rq6({"lambada_stdlib perplexity": ppl, "nextline_stdlib acc_norm": nextline, "python_mc acc_norm": quiz})
    return from_parts(measured, parts, figure, "The three tasks against the rotated fraction, per seed.",
                      "LAMBADA accuracy is 0 for every tiny model (they predict no whole identifier), so the verdict reads "
                      "perplexity, as the seed's Fig. 5 does. python_mc has 8 items: a flat accuracy there is weak evidence.",
                      regime(study, largest_only=True))


def _plot_spikes(study: StudyFolder) -> bytes:
    fig = new_figure(6.5, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    spikes = {row["id"]: row["spike_list"] for row in study.rows}
    for index, run in enumerate(study.runs):
        ax.plot(run.steps, run.losses, lw=0.9, color=f"C{index}", label=run.id)
        marks = spikes.get(run.id, [])
        ax.plot([s["step"] for s in marks], [s["loss"] for s in marks], "v", ms=7, color=f"C{index}")
    finish_axes(ax, "step", "training loss", log_y=True)
    return png_bytes(fig)


def _judge_spikes(studies: Mapping[str, Path]) -> Finding:
    study = StudyFolder(studies["partial-spikes"])
    counts = seed_groups(study.rows, "spikes", ["nope", "nope-qknorm"])
    parts = [("NoPE spikes (every seed)", present(counts["nope"])),
             ("QK-Norm leaves fewer spikes", lower(pick(counts, "nope-qknorm"), pick(counts, "nope")))]
    losses = seed_groups(study.rows, variants=["nope", "nope-qknorm"])
    peaks = {variant_of(run.id) + f" seed {run.config.get('seed', 0)}": float(max(run.losses[1:], default=float("nan")))
             for run in study.runs}
    measured = ("NoPE on parallel (Pythia-style) blocks, d_model 128, byte-level stdlib, without gradient clipping, "
                f"{study.schedule()}, with and without QK-Norm. Loss spikes "
                f"counted by the study's detector (rolling median + MAD): {mean_text(counts, '.0f')}. Highest training loss "
                f"after the first step: {', '.join(f'{k} {v:.2f}' for k, v in peaks.items())} (the untrained model "
                f"scores about 5.6). Final validation loss: {mean_text(losses)}.")
    return from_parts(measured, parts, _plot_spikes(study), "Training loss; triangles mark the detected spikes.",
                    "The seed's spikes come after tens of billions of tokens; at 0.4M tokens a raised learning rate "
                    "stands in for that budget, as in the seed's Fig. 6(b). The detector needs 10 points of history, so "
                    "a blow-up in the first steps shows in the highest loss and the figure, not in the count. "
                    + still_falling_note(study), runs_regime(study))


PARTIAL_CLAIMS: list[Claim] = [
    Claim("rq1", SEED, "Sec. 4, RQ1",
          "Models with NoPE or RoPE on two channels converge to a higher final loss; 10 % of the channels rotated "
          "and more match full RoPE.",
          (SCALING,), _judge_rq1, SEED_REGIME),
    Claim("rq2", SEED, "Sec. 4, RQ2",
          "The same two bands form on a second pretraining corpus of a different quality (FineWeb-Edu beside FineWeb).",
          ("partial-prose", SCALING), _judge_rq2, SEED_REGIME),
    Claim("rq3", SEED, "Sec. 4, RQ3",
          "The bands hold at several training lengths, and the 10 % run drifts slightly above the >= 25 % band as the "
          "length grows.",
          ("partial-lengths", SCALING), _judge_rq3, SEED_REGIME),
    Claim("rq4", SEED, "Sec. 4, RQ4",
          "Parallel (Pythia) blocks give the same bands once NoPE is set aside, and NoPE fails to converge there.",
          ("partial-pythia",),
          _frontier_bands("partial-pythia", [["nope"], ["2ch"], ["rope10", "rope100"]],
                          "parallel blocks (Pythia-style: LayerNorm, GELU, attention and MLP side by side) of 2 layers, "
                          f"d_model 64, one head of 64, {ENGLISH}",
                          "At tiny scale no run diverges; 'fails to converge' is read as NoPE ending above every RoPE "
                          "variant, 2ch included, by more than the noise (first row); the next rows are the seed's two "
                          "bands without NoPE."),
          SEED_REGIME),
    Claim("rq5", SEED, "Sec. 4, RQ5",
          "A larger model gives the same bands, its RoPE variants slightly more spread.",
          (SCALING,), _judge_rq5, SEED_REGIME),
    Claim("rq6", SEED, "Sec. 4, RQ6",
          "LAMBADA perplexity drops sharply from < 10 % to >= 10 % rotated, while multiple-choice accuracy stays flat.",
          (SCALING_CODE,), _judge_rq6, SEED_REGIME),
    Claim("spikes", SEED, "Sec. 4, Analyzing loss spikes with NoPE",
          "NoPE shows loss spikes (at long lengths, or with a raised learning rate), and QK-Norm removes them.",
          ("partial-spikes",), _judge_spikes, "tens of billions of tokens before the spikes (1B parallel blocks)"),
]
