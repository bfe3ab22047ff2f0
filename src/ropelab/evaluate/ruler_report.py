"""The RULER section of longctx.md: what was run (essay haystack, BOS, items, interval, the threshold's
source), then per run the score of every task at every length with its item count and 95% interval,
the RULER-11 mean per length and the effective length (only when all 11 tasks ran), where an essay
haystack repeated its text, and the answer rank (MRR) of every task at every length.
Pure functions of the results dict of `ropelab.evaluate.longctx.evaluate_longctx`."""

from __future__ import annotations

from ropelab.evaluate.ruler_score import RULER_11, THRESHOLD_SOURCE
from ropelab.evaluate.ruler_tasks import ESSAY_TASKS, RULER_TASKS


def _score(cell: dict) -> str:
    low, high = cell["interval"]
    return f"{cell['score']:.1f} ({low:.1f}–{high:.1f}, n={cell['n']})"


def _mrr(cell: dict) -> str:
    return f"{cell['mrr']:.2f}"


def _table(run: dict, names: list[str], lengths: list[int], show) -> list[str]:
    lines = ["| task | " + " | ".join(str(n) for n in lengths) + " | all |", "|" + "---|" * (len(lengths) + 2)]
    for name in names:
        task = run["tasks"][name]
        by_length = {cell["length"]: cell for cell in task["cells"]}
        lines.append(f"| {name} | " + " | ".join(show(by_length[n]) for n in lengths) + f" | {show(task)} |")
    return lines


def _run_lines(run: dict, names: list[str], lengths: list[int]) -> list[str]:
    summary = run["ruler"]
    lines = ["", f"### {run['label']}: score (%, 95% interval, items)", "", *_table(run, names, lengths, _score)]
    if summary["complete"]:
        mean = " | ".join(f"**{summary['average'][str(n)]:.1f}**" for n in lengths)
        overall = sum(summary["average"].values()) / len(summary["average"])
        lines += [f"| {RULER_11} | {mean} | **{overall:.1f}** |", "",
                  f"Effective length (the longest length whose {RULER_11} mean is above {summary['threshold']:g}): "
                  f"**{summary['effective_length_text']}**."]
    else:
        lines += ["", f"No {RULER_11} mean and no effective length: they need all 11 tasks, and {len(names)} ran."]
    lines += ["", f"BOS: {summary['bos']}."]
    if summary["haystack_repeats"]:
        where = ", ".join(f"{r['task']} at {r['length']}" for r in summary["haystack_repeats"])
        lines.append(f"The essay haystack repeats its text (the haystack needs more words than it has) in: {where}.")
    lines += ["", f"### {run['label']}: answer rank (MRR)", "", *_table(run, names, lengths, _mrr)]
    return lines


def ruler_markdown(results: dict) -> list[str]:
    """The RULER section's lines; none when no RULER task was run."""
    settings = results["settings"]
    names = [task for task in settings["tasks"] if task in RULER_TASKS]
    if not names:
        return []
    lengths = settings["lengths"]
    new_tokens = {("NIAH" if name.startswith("niah") else name): RULER_TASKS[name].max_new_tokens for name in names}
    items = settings["items"]
    lines = ["", "## RULER", "",
             "Score: string_match_all, the share of the references found in the greedy output (%), with its "
             f"{results['runs'][0]['ruler']['interval']} and the number of items n. "
             f"{items} item{'' if items == 1 else 's'} per task and length, seed {settings['seed']}; a length counts "
             f"the prompt and the new tokens ({', '.join(f'{k} {v}' for k, v in new_tokens.items())}). Answer rank: "
             f"the true answer among {settings['distractors'] + 1} candidates by log-likelihood, as mean reciprocal rank. "
             f"The threshold of the effective length: {THRESHOLD_SOURCE}."]
    essay_names = [name for name in names if name in ESSAY_TASKS]
    if essay_names:
        lines += ["", f"Essay haystack ({', '.join(essay_names)}): **{results['haystack']['name']}**, "
                      f"{results['haystack']['description']}."]
    else:
        lines += ["", f"Essay haystack: {settings['haystack']} (none of the tasks run uses it)."]
    for run in results["runs"]:
        lines += _run_lines(run, names, lengths)
    return lines
