"""The smallest RoPE base that keeps token discrimination alive over a context length.

Men et al. 2024 ("Base of RoPE Bounds Context Length", arXiv 2405.14591, cited in §2 of the
partial-RoPE seed) look at how much more attention a query q gives to a key similar to it
(k* = q + noise) than to a random key k, at relative distance m. With i.i.d. query and key
components of variance sigma^2, that margin is 2 sigma^2 B(m) with

    B(m) = sum_{i=0}^{d/2-1} cos(m * theta_i),      theta_i = base^(-2i/d),

d the rotated channels. B(0) = d/2 and B oscillates as m grows; where it turns negative, the
similar key gets *less* attention than a random one. Their lower bound on the base for context
length L is the smallest base with B(m) >= 0 for every integer m in [0, L]. This module computes
that definition numerically (no closed form exists):

  * `discrimination(m, base, d)` is B(m) for given distances (float64: m * theta stays exact to
    ~1e-10 rad up to m ~ 1e6); `discrimination_upto(base, d, L)` is B(0..L), by angle addition;
  * `first_negative(base, d, L)` is the first distance with B(m) < 0 (None: the base passes);
    `first_negative_of(freqs, L)` the same for any frequencies (a plan's, or a scaled spectrum);
  * `base_lower_bound(L, d)` is the infimum of the passing bases. They do not form an interval: on
    a fine grid, passing islands appear well below the base from which every larger one passes
    (d = 128, L = 8192: the first island starts near 8.4e4, the unbroken run near 1.8e5), so a grid
    or a bisection would miss the infimum. The search starts at base 1 and only ever skips bases
    proven to fail. At the current base it computes B(m) for all m <= L; if none is negative, that
    base is the answer. Otherwise, for the most negative distances it finds the next root of that
    distance's B(m) as a function of u = ln(base) and jumps to the largest of those roots (every
    base skipped fails for that distance). A root is approached in steps over which B(m) provably
    stays negative: the phases m * theta_i only shrink as u grows, so S1 = sum_i m theta_i 2i/d
    bounds |dB/du| and S2 = sum_i m theta_i (2i/d)^2 (m theta_i + 1) bounds |d2B/du2| from here on,
    and B + t S1 and B + t dB/du + t^2 S2 / 2 stay negative up to their roots in t.
    The result is exact up to a relative step floor of 1e-9, and to that precision monotone in L.
    Cost: about 15 s for L = 128k on one CPU core, growing with L and with the bound.

Frequencies are `ropelab.rope.frequencies.inverse_frequencies` with the ``slice`` style (the
spectrum squeezed into the rotated channels), so ``d`` is ``rotary_dims``. With d = 2 the only frequency is 1 rad per
token and B(2) = cos 2 < 0 whatever the base: no base works for L >= 2 (reported as infinity).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ropelab.errors import ConfigError

MAX_BASE = 1e30  # beyond this no bound is reported (d = 16 already needs 1.1e11 at 128k tokens)
_STEP_FLOOR = 1e-9  # smallest step in ln(base): the bound's relative precision
_ADVANCE_DISTANCES = 64  # failing distances (the most negative) whose next roots bound each jump
_BLOCK = 1024  # distances per block of the angle-addition table


def _exponents(rotary_dims: int) -> np.ndarray:
    return np.arange(0, rotary_dims, 2, dtype=np.float64) / rotary_dims


def _frequencies(base: float, rotary_dims: int) -> np.ndarray:
    """`ropelab.rope.frequencies.inverse_frequencies` (slice style) in numpy: theta_i = base^(-2i/d)."""
    return float(base) ** -_exponents(rotary_dims)


def discrimination(distances: np.ndarray | Sequence[int], base: float, rotary_dims: int) -> np.ndarray:
    """B(m) = sum_i cos(m * theta_i) for each distance m (Men et al. 2024)."""
    m = np.asarray(distances, dtype=np.float64)
    return np.cos(np.multiply.outer(m, _frequencies(base, rotary_dims))).sum(-1)


def discrimination_upto(base: float, rotary_dims: int, context: int) -> np.ndarray:
    """B(m) for every m = 0..context, by angle addition: with m = s + k (s a multiple of K, k < K),
    cos(m theta) = cos(s theta) cos(k theta) - sin(s theta) sin(k theta), so summing over the pairs is
    a matrix product of a (K, d/2) table by (d/2, blocks) one, far cheaper than a cosine per (m, pair)."""
    return frequency_discrimination_upto(_frequencies(base, rotary_dims), context)


def frequency_discrimination_upto(freqs: np.ndarray, context: int) -> np.ndarray:
    """`discrimination_upto` for any set of pair frequencies (a plan's, a truncated or scaled spectrum)."""
    freqs = np.asarray(freqs, dtype=np.float64)
    k = np.arange(_BLOCK, dtype=np.float64)
    starts = np.arange(0, context + 1, _BLOCK, dtype=np.float64)
    block_angles = np.multiply.outer(starts, freqs).T  # (d/2, blocks)
    offsets = np.multiply.outer(k, freqs)  # (K, d/2)
    values = np.cos(offsets) @ np.cos(block_angles) - np.sin(offsets) @ np.sin(block_angles)  # (K, blocks)
    return values.T.ravel()[: context + 1]


def first_negative(base: float, rotary_dims: int, context: int) -> Optional[int]:
    """The smallest integer distance m in [0, context] with B(m) < 0, or None if there is none."""
    return first_negative_of(_frequencies(base, rotary_dims), context)


def first_negative_of(freqs: np.ndarray, context: int) -> Optional[int]:
    """`first_negative` for any set of pair frequencies."""
    negative = np.flatnonzero(frequency_discrimination_upto(freqs, context) < 0)
    return int(negative[0]) if negative.size else None


def _check(context: int, rotary_dims: int) -> None:
    if rotary_dims < 2 or rotary_dims % 2:
        raise ConfigError(f"rotary_dims={rotary_dims}: must be an even number >= 2 (NoPE has no base)")
    if context < 1:
        raise ConfigError(f"context={context}: must be >= 1 token")


def _next_roots(distances: np.ndarray, log_base: float, rotary_dims: int) -> np.ndarray:
    """For each distance m, the smallest ln(base) >= log_base where B(m) >= 0 (inf beyond MAX_BASE),
    reached in steps that each skip only bases where B(m) < 0 (see the module docstring)."""
    x = _exponents(rotary_dims)
    m = distances.astype(np.float64)
    u = np.full(m.shape, log_base)
    live = np.ones(m.shape, dtype=bool)
    while live.any():
        index = np.flatnonzero(live)
        phases = m[index, None] * np.exp(-np.multiply.outer(u[index], x))  # phi_i = m theta_i
        value = np.cos(phases).sum(-1)  # B(m)
        slope = (np.sin(phases) * phases * x).sum(-1)  # dB/du, u = ln(base)
        first = (phases * x).sum(-1)  # S1 >= |dB/du| from here on (every phi_i only shrinks as u grows)
        second = (phases * x * x * (phases + 1)).sum(-1)  # S2 >= |d2B/du2| from here on
        with np.errstate(divide="ignore", invalid="ignore"):
            # B(u + t) <= B + t slope + t^2 second / 2 and <= B + t first: negative up to each bound's root.
            quadratic = (np.sqrt(slope**2 - 2 * second * value) - slope) / second
            step = np.fmax(np.fmax(quadratic, -value / first), _STEP_FLOOR)
        done = value >= 0
        live[index[done]] = False
        u[index[~done]] += step[~done]
        beyond = live & (u > math.log(MAX_BASE))  # also d = 2, where B(m) = cos(m) never changes
        u[beyond] = math.inf
        live &= ~beyond
    return u


def base_lower_bound(context: int, rotary_dims: int) -> float:
    """Smallest RoPE base with B(m) >= 0 for all m in [0, context] (Men et al. 2024); inf if above MAX_BASE."""
    _check(context, rotary_dims)
    log_base = 0.0
    while math.isfinite(log_base):
        base = math.exp(log_base)
        values = discrimination_upto(base, rotary_dims, context)
        failing = np.flatnonzero(values < 0)
        if not failing.size:
            return base
        # Every base below the largest of these roots fails for that root's distance: skip them all.
        if failing.size > _ADVANCE_DISTANCES:
            failing = failing[np.argpartition(values[failing], _ADVANCE_DISTANCES)[:_ADVANCE_DISTANCES]]
        log_base = max(float(_next_roots(failing, log_base, rotary_dims).max()), log_base + _STEP_FLOOR)
    return math.inf


def bound_table(contexts: Sequence[int], dims: Sequence[int], thetas: Sequence[float] = (), progress: bool = False) -> list[dict]:
    """One row per (rotary_dims, context): the bound (None above MAX_BASE) and, for each base in `thetas`,
    the first distance where its B(m) turns negative (None: B(m) >= 0 over the whole context)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    for d in dims:
        for context in contexts:
            _check(context, d)
    for theta in thetas:
        if not 0 < theta < math.inf:
            raise ConfigError(f"theta={theta}: must be a finite number > 0 (a RoPE base)")
    rows = []
    with Progress(TextColumn("[bold]rope base bound[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), disable=not progress, transient=True) as bar:
        task = bar.add_task("", total=len(dims) * len(contexts))
        for d in dims:
            for context in contexts:
                bar.update(task, description=f"{d} dims, {context:,} tokens")
                bound = base_lower_bound(context, d)
                rows.append({
                    "rotary_dims": d, "context": context, "base_lower_bound": bound if math.isfinite(bound) else None,
                    "first_negative": {theta: first_negative(theta, d, context) for theta in thetas},
                })
                bar.advance(task)
    return rows
