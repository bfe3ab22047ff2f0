"""The RULER section of longctx.md: per run, the score of every task at every length, the average per
length and the effective length, then the answer rank (MRR) of every task at every length.
Pure functions of the results dict of `ropelab.evaluate.longctx.evaluate_longctx`."""

from __future__ import annotations

from ropelab.evaluate.ruler_tasks import RULER_TASKS


def _table(run: dict, names: list[str], lengths: list[int], metric: str, digits: int) -> list[str]:
    lines = ["| task | " + " | ".join(str(n) for n in lengths) + " | all |", "|" + "---|" * (len(lengths) + 2)]
    for name in names:
        task = run["tasks"][name]
        by_length = {cell["length"]: cell[metric] for cell in task["cells"]}
        lines.append(f"| {name} | " + " | ".join(f"{by_length[n]:.{digits}f}" for n in lengths)
                     + f" | {task[metric]:.{digits}f} |")
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
             "Score: string_match_all, the share of the references found in the greedy output (%). "
             f"{items} item{'' if items == 1 else 's'} per task and length, seed {settings['seed']}; a length counts "
             f"the prompt and the new tokens ({', '.join(f'{k} {v}' for k, v in new_tokens.items())}). Answer rank: "
             f"the true answer among {settings['distractors'] + 1} candidates by log-likelihood, as mean reciprocal rank."]
    for run in results["runs"]:
        summary = run["ruler"]
        average = " | ".join(f"**{summary['average'][str(n)]:.1f}**" for n in lengths)
        overall = sum(summary["average"].values()) / len(summary["average"])
        lines += ["", f"### {run['label']}: score (%)", "", *_table(run, names, lengths, "score", 1),
                  f"| average | {average} | **{overall:.1f}** |", "",
                  f"Effective length (the longest length whose average is above {summary['threshold']:g}): "
                  f"**{summary['effective_length_text']}**.",
                  "", f"### {run['label']}: answer rank (MRR)", "", *_table(run, names, lengths, "mrr", 2)]
    return lines
