"""The report section of the scaling-law fits (`ropelab.study.fit`): tables of the fitted laws with
their bootstrap intervals, the gaps between variants, a held-out check per variant and size, a
figure of loss against tokens with the fitted curves, and the profiles of E and the exponents
(`ropelab.study.fit_profiles`) as a table, a figure and a sentence saying which the data identify. The laws, named budgets and gaps share one set
of resamples (`fit_variants`, then `fit_gaps`); the held-out checks refit theirs in one batch
(`held_out_checks`)."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

import numpy as np

from ropelab.config import ConfigError
from ropelab.study.bootstrap import DEFAULT_RESAMPLES, MIN_SEEDS, Estimate
from ropelab.study.fit import MIN_BUDGETS, Point, check_points
from ropelab.study.fit_checks import held_out_checks
from ropelab.study.fit_profiles import Profile
from ropelab.study.variant_fits import DEFAULT_BUDGETS, Gap, VariantFit, fit_gaps, fit_variants
from ropelab.study.plots import new_figure, png_bytes
from ropelab.study.section import Section, html_table, markdown_table

FIGURE_NAME = "scaling_fit.png"
PROFILE_FIGURE_NAME = "fit_profiles.png"
SEED_MARKERS = "os^Dvp*hX"
SIZE_LINESTYLES = ("-", "--", ":", "-.")
MAX_EXTRAPOLATION = 10.0  # a loss predicted further outside the measured budgets than this factor is not shown
STEP_ROUNDING = 1.01  # a study's budgets are rounded to whole optimizer steps: within 1 % counts as measured


def at_budget(estimate: Estimate, tokens: float, measured: tuple[float, float]) -> str:
    """A value predicted at `tokens`, with how far outside the `measured` (smallest, largest) budgets it
    lies; "n/a" further than `MAX_EXTRAPOLATION`."""
    smallest, largest = measured
    if tokens > largest * STEP_ROUNDING:
        factor, where = tokens / largest, "past the largest budget measured"
    elif tokens * STEP_ROUNDING < smallest:
        factor, where = smallest / tokens, "short of the smallest budget measured"
    else:
        return str(estimate)
    how_far = f"{factor:,.0f}x {where}" if factor >= 10 else f"{factor:.2g}x {where}"
    if factor > MAX_EXTRAPOLATION:
        return f"n/a ({how_far}; shown up to {MAX_EXTRAPOLATION:g}x)"
    return f"{estimate} ({how_far})"


def fit_tables(fits: Sequence[VariantFit], budgets: Mapping[str, float],
               gaps: Sequence[Gap] = ()) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows) of each table: the data law per variant and size, the joint law of the variants
    that have one, the gaps; values as "fit [95 % interval]", and losses predicted outside the budgets
    measured (a gap's: those both variants measured) marked with how far (`at_budget`)."""
    names = list(budgets)
    header = ["variant", "N (non-embedding)", "budgets", "runs", "E", "beta", *(f"loss at {n}" for n in names)]
    rows = [[fit.variant, f"{size.params:.3g}", str(size.n_budgets), str(size.law.n_points), str(size.estimates["E"]),
             str(size.estimates["beta"]),
             *(at_budget(size.estimates[f"loss at {n}"], ratio * size.params, (size.budgets[0], size.budgets[-1]))
               for n, ratio in budgets.items())]
            for fit in fits for size in fit.sizes]
    tables = [(header, rows)]
    joint = [fit for fit in fits if fit.joint is not None]
    if joint:
        tables.append((["variant", "E", "A", "alpha", "B", "beta"],
                       [[fit.variant, str(fit.joint_estimates["E"]), f"{fit.joint.A:.4g}",
                         str(fit.joint_estimates["alpha"]), f"{fit.joint.B:.4g}", str(fit.joint_estimates["beta"])]
                        for fit in joint]))
    if gaps:
        sizes = {(fit.variant, size.params): size for fit in fits for size in fit.sizes}

        def both_measured(g: Gap) -> tuple[float, float]:
            a, b = sizes[g.a, g.params], sizes[g.b, g.params]
            return max(a.budgets[0], b.budgets[0]), min(a.budgets[-1], b.budgets[-1])

        tables.append((["gap (loss of a - loss of b)", "N (non-embedding)", "budget", "tokens", "gap"],
                       [[f"{g.a} - {g.b}", f"{g.params:.3g}", g.budget, f"{g.tokens:.3g}",
                         at_budget(g.estimate, g.tokens, both_measured(g))] for g in gaps]))
    return tables


def plot_fits(points: Sequence[Point], fits: Sequence[VariantFit]) -> bytes:
    """Loss against tokens (log x): every run as a point (marker = seed), the fitted L(D) of each
    variant and size as a line (colour = variant, line style = size)."""
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    seeds = sorted({p.seed for p in points}, key=str)
    fig = new_figure(7.5, 4.5)
    ax = fig.subplots()
    for v, fit in enumerate(fits):
        color = palette(v % 10)
        for s, size in enumerate(fit.sizes):
            members = [p for p in points if p.variant == fit.variant and p.params == size.params]
            for p in members:
                ax.plot(p.tokens, p.loss, SEED_MARKERS[seeds.index(p.seed) % len(SEED_MARKERS)], color=color,
                        alpha=0.6, ms=5)
            tokens = np.geomspace(min(p.tokens for p in members), max(p.tokens for p in members), 200)
            ax.plot(tokens, size.law.predict(tokens), SIZE_LINESTYLES[s % len(SIZE_LINESTYLES)], color=color, lw=1.5,
                    label=f"{fit.variant} N={size.params:.3g}: E={size.law.E:.3g}, beta={size.law.beta:.3g}")
    if len(seeds) > 1:
        for s, seed in enumerate(seeds):
            ax.plot([], [], SEED_MARKERS[s % len(SEED_MARKERS)], color="grey", label=f"seed {seed}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens D")
    ax.set_ylabel("loss")
    ax.set_title("loss against tokens, fitted L(D) = E + B D^-beta (markers: seeds)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return png_bytes(fig)


def _law_profiles(fits: Sequence[VariantFit]) -> list[tuple[str, str, dict[str, Profile]]]:
    """(variant, law, its profiles) of each fitted law: the joint law first, then each size's data law."""
    return [(fit.variant, law, profiles) for fit in fits
            for law, profiles in ([("L(N, D)", fit.joint_profiles)] if fit.joint_profiles else [])
            + [(f"L(D) at N={size.params:.3g}", size.profiles) for size in fit.sizes] if profiles]


def profile_table(fits: Sequence[VariantFit]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): each profiled parameter of each law with its best fit and profile interval."""
    return (["variant", "law", "parameter", "best fit", "profile interval", "identified?"],
            [[variant, law, name, f"{p.best:.4g}", p.interval_text, "yes" if p.identified else "no"]
             for variant, law, profiles in _law_profiles(fits) for name, p in profiles.items()])


def identified_sentence(fits: Sequence[VariantFit]) -> str:
    """One sentence: for E, alpha and beta, the joint laws and the data laws whose profiles identify it."""
    clauses = []
    for name in ("E", "alpha", "beta"):
        joint = [fit for fit in fits if name in fit.joint_profiles]
        sizes = [size.profiles[name] for fit in fits for size in fit.sizes if name in size.profiles]
        said = []
        if joint:
            named = [fit.variant for fit in joint if fit.identified(name)]
            said.append(f"in the joint law of {len(named)} of {len(joint)} variants"
                        + (f" ({', '.join(named)})" if 0 < len(named) < len(joint) else ""))
        if sizes:
            said.append(f"in the data law of {sum(p.identified for p in sizes)} of {len(sizes)} sizes")
        if said:
            clauses.append(f"{name} {' and '.join(said)}")
    return ("The data identify (profile interval bounded inside the grid searched) " + "; ".join(clauses) + "."
            if clauses else "")


def plot_profiles(fits: Sequence[VariantFit]) -> bytes:
    """A panel per parameter: the profile's objective over its minimum against the parameter's value,
    a line per law (the joint laws when there are any, else the data laws), its threshold dotted."""
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    joint = any(fit.joint_profiles for fit in fits)
    laws = [(v, variant, law, profiles) for v, fit in enumerate(fits) for variant, law, profiles in _law_profiles([fit])
            if (law == "L(N, D)") == joint]
    names = [name for name in ("E", "alpha", "beta") if any(name in profiles for *_, profiles in laws)]
    fig = new_figure(3.6 * len(names), 3.4)
    for column, name in enumerate(names):
        ax = fig.add_subplot(1, len(names), column + 1)
        for s, (v, variant, law, profiles) in enumerate(laws):
            p = profiles[name]
            floor = max(p.minimum, 1e-300)
            style = "-" if joint else SIZE_LINESTYLES[s % len(SIZE_LINESTYLES)]
            ax.plot(p.values, p.objectives / floor, style, color=palette(v % 10), lw=1.3,
                    label=variant if joint else f"{variant} {law.removeprefix('L(D) at ')}")
            ax.axhline(p.threshold / floor, color=palette(v % 10), ls=":", lw=0.8)
            ax.plot([p.best], [1.0], "o", color=palette(v % 10), ms=4)
        ax.set_yscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("objective / its minimum")
        ax.grid(alpha=0.3, which="both")
        if column == 0:
            ax.legend(fontsize=6, frameon=False)
    fig.suptitle(f"profiles of the {'joint laws L(N, D)' if joint else 'data laws L(D)'} "
                 "(dotted: the 95 % threshold)", fontsize=10)
    fig.tight_layout()
    return png_bytes(fig)


def _held_out_lines(points: Sequence[Point], fits: Sequence[VariantFit], resamples: int, seed: int) -> list[str]:
    checks = held_out_checks(points, resamples, seed)
    lines = []
    for fit in fits:
        for size in fit.sizes:
            check = checks[fit.variant, size.params]
            lines.append(f"held-out check {fit.variant} N={size.params:.3g}: not possible ({check})"  # too few budgets
                         if isinstance(check, ConfigError) else str(check))
    return lines


def fit_section(points: Sequence[Point], budgets: Mapping[str, float] = DEFAULT_BUDGETS,
                resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> Section:
    """The "Scaling-law fits" section, from the variants' sizes with 3 budgets or more (the others are
    named as not fitted); one line saying why when no variant has a size with 3 budgets. Gaps are each
    variant against the first one."""
    points = check_points(points)
    tokens_by_size: dict[tuple[str, float], set[float]] = {}
    for p in points:
        tokens_by_size.setdefault((p.variant, p.params), set()).add(p.tokens)
    fittable = {key for key, tokens in tokens_by_size.items() if len(tokens) >= MIN_BUDGETS}
    if not fittable:
        most = max(len(tokens) for tokens in tokens_by_size.values())
        why = (f"No fit: a scaling-law fit needs at least {MIN_BUDGETS} token budgets per variant and model size, "
               f"and this study has {'only one' if most == 1 else f'at most {most}'}.")
        return Section("Scaling-law fits", why, f"<p>{html.escape(why)}</p>")
    fitted = [p for p in points if (p.variant, p.params) in fittable]
    fits = fit_variants(fitted, budgets, resamples, seed)
    baseline = fits[0]
    gaps = [g for fit in fits[1:] if {s.params for s in fit.sizes} & {s.params for s in baseline.sizes}
            for g in fit_gaps(fits, fit.variant, baseline.variant, budgets)]
    tables = fit_tables(fits, budgets, gaps)
    checks = _held_out_lines(fitted, fits, resamples, seed)
    skipped = [f"{variant} N={params:.3g}" for variant, params in tokens_by_size if (variant, params) not in fittable]
    intro = ("L(D) = E + B D^-beta per variant and model size, and L(N, D) = E + A N^-alpha + B D^-beta for variants "
             "with 3 sizes or more, fitted as Hoffmann et al. 2022 (approach 3): Huber loss of log residuals, "
             "scipy's L-BFGS-B from a grid. Brackets: 95 % bootstrap intervals over seeds and the points of each seed "
             f"({resamples} resamples, the same for the laws, budgets and gaps; intervals need at least {MIN_SEEDS} "
             "seeds). Budgets in tokens per parameter: "
             + ", ".join(f"{name} = {ratio:g} N" for name, ratio in budgets.items())
             + f"; a loss predicted outside the budgets measured says how far, and is not shown past "
               f"{MAX_EXTRAPOLATION:g}x.")
    notes = checks + ([f"not fitted (fewer than {MIN_BUDGETS} budgets): {', '.join(skipped)}"] if skipped else [])
    profiles = (f"Profiles: each of E, alpha and beta held on a grid from 0 up (E: to just below the smallest loss; "
                "an exponent: to 3x its fit, at least 1) with the law's other parameters refitted; the interval is where "
                "the summed Huber loss stays under its minimum x (1 + F(0.95; 1, n - p) / (n - p)), the F-test form of a "
                "95 % interval for least squares, approximate under the Huber loss. " + identified_sentence(fits))
    markdown = "\n\n".join([intro, f"![scaling fit]({FIGURE_NAME})",
                            *(markdown_table(h, r) for h, r in tables), profiles, f"![profiles]({PROFILE_FIGURE_NAME})",
                            markdown_table(*profile_table(fits)), "\n".join(f"- {line}" for line in notes)])
    html_text = (f"<p>{html.escape(intro)}</p>" + "".join(html_table(h, r) for h, r in tables)
                 + f"<p>{html.escape(profiles)}</p>" + html_table(*profile_table(fits))
                 + "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in notes) + "</ul>")
    return Section("Scaling-law fits", markdown, html_text,
                   {FIGURE_NAME: plot_fits(fitted, fits), PROFILE_FIGURE_NAME: plot_profiles(fits)})
