"""Pure analysis of training curves for the partial-RoPE study: smoothing, loss-spike
detection, convergence bands and steps-to-target. Everything here takes plain sequences /
numpy arrays and returns plain Python values; nothing reads files or draws.

Conventions
  * ``steps`` and ``losses`` are 1-D, the same length, ordered by step. Non-finite losses
    (NaN / inf, a diverged step) are allowed: they never enter a baseline or a mean, and a
    non-finite value after a finite history counts as a spike.
  * Windows are counted in *logged points*, not steps (with ``train.log_every = 1`` they are
    the same).
  * "Final loss" is the mean of the last ``tail_fraction`` (10 %) of the run, measured in
    steps; see `final_loss`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Hashable, Iterable, Mapping, Optional, Sequence

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD * 1.4826 estimates the standard deviation of Gaussian noise

__all__ = [
    "Spike",
    "smooth",
    "rolling_median_mad",
    "detect_spikes",
    "final_loss",
    "tail_noise",
    "estimate_noise",
    "convergence_bands",
    "steps_to_target",
]


# --------------------------------------------------------------------------- smoothing


def smooth(values: Sequence[float], window: int, kind: str = "centered") -> np.ndarray:
    """Smoothed copy of `values` (same length, float64).

    kind="centered" (default): centered rolling mean over ``2*(window//2) + 1`` points. Near
      the ends the window shrinks *symmetrically* (point i averages ``min(h, i, n-1-i)``
      neighbours on each side), so a trend is not biased at the edges: the first and last
      points are the raw values. No lag: a linear trend is reproduced exactly.
    kind="ema": causal exponential moving average with ``alpha = 2 / (window + 1)`` (the
      "span" convention), bias-corrected for the start like Adam / TensorBoard, so the first
      output equals the first input. Lags a decreasing curve by about window/2 points.

    Non-finite inputs are skipped (they never contaminate neighbours); an output is NaN where
    the input is non-finite (EMA) or where no finite value falls in the window (centered).
    ``window <= 1`` returns a float copy.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    if n == 0 or window <= 1:
        return x.copy()
    finite = np.isfinite(x)
    if kind == "centered":
        h = int(window) // 2
        idx = np.arange(n)
        half = np.minimum(np.minimum(idx, n - 1 - idx), h)
        csum = np.concatenate(([0.0], np.cumsum(np.where(finite, x, 0.0))))
        ccnt = np.concatenate(([0], np.cumsum(finite)))
        lo, hi = idx - half, idx + half + 1
        total, count = csum[hi] - csum[lo], ccnt[hi] - ccnt[lo]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, total / np.maximum(count, 1), np.nan)
    if kind == "ema":
        alpha = 2.0 / (float(window) + 1.0)
        out = np.full(n, np.nan)
        acc, weight = 0.0, 0.0
        for i in range(n):
            if finite[i]:
                acc = (1 - alpha) * acc + alpha * x[i]
                weight = (1 - alpha) * weight + alpha
                out[i] = acc / weight
        return out
    raise ValueError(f"smooth: kind={kind!r}; expected 'centered' or 'ema'")


# ------------------------------------------------------------------------------ spikes


@dataclass(frozen=True)
class Spike:
    """One loss spike. Readable as attributes or as a mapping (``spike["step"]``).

    step / loss: the peak of the spike (highest loss in the contiguous run of points above
      the detection threshold; a non-finite loss is the peak if present).
    start_step: first step above the threshold.
    baseline / mad: the trailing rolling median and MAD (scaled to a sigma) just before it.
    band: ``baseline + band_k * mad``, the pre-spike band the loss must return to.
    recovered: the loss later came back inside ``band`` and stayed there for
      ``recover_points`` consecutive points; recovery_step is the first step of that stretch.
    """

    step: int
    loss: float
    baseline: float
    mad: float
    band: float
    start_step: int
    recovered: bool
    recovery_step: Optional[int]

    @property
    def jump(self) -> float:
        """Relative height of the peak above the baseline."""
        return self.loss / self.baseline - 1.0 if self.baseline else math.inf

    def to_dict(self) -> dict:
        return asdict(self) | {"jump": self.jump}

    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def keys(self):
        return self.to_dict().keys()


def rolling_median_mad(values: Sequence[float], window: int, min_periods: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Trailing rolling median and MAD (scaled by 1.4826 to estimate a standard deviation).

    Entry i summarises the up-to-`window` finite points *before* i (i itself excluded); it is
    NaN while fewer than `min_periods` finite points are available."""
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    med, mad = np.full(n, np.nan), np.full(n, np.nan)
    if n == 0 or window < 1:
        return med, mad
    xf = np.where(np.isfinite(x), x, np.nan)
    # Points with a full window: vectorised over a sliding view of the previous `window` values.
    if n > window:
        view = np.lib.stride_tricks.sliding_window_view(xf[:-1], window)  # row r covers [r, r+window)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows
            m = np.nanmedian(view, axis=1)
            d = np.nanmedian(np.abs(view - m[:, None]), axis=1)
            counts = np.sum(np.isfinite(view), axis=1)
        ok = counts >= min_periods
        med[window:] = np.where(ok, m, np.nan)
        mad[window:] = np.where(ok, d * MAD_TO_SIGMA, np.nan)
    # The first points: an expanding window.
    for i in range(1, min(window, n)):
        hist = xf[:i]
        hist = hist[np.isfinite(hist)]
        if hist.size >= min_periods:
            m = float(np.median(hist))
            med[i], mad[i] = m, float(np.median(np.abs(hist - m))) * MAD_TO_SIGMA
    return med, mad


def detect_spikes(
    steps: Sequence[int],
    losses: Sequence[float],
    window: int = 50,
    threshold: float = 6.0,
    min_jump: float = 0.05,
    band_k: float = 3.0,
    recover_points: int = 10,
    min_periods: int = 10,
    min_points: int = 3,
) -> list[Spike]:
    """Loss spikes found with robust trailing statistics.

    For each point i, the baseline is the median of the previous `window` finite losses and
    the noise is their MAD (scaled to a sigma, see `rolling_median_mad`). Point i starts a
    spike when both
      * ``loss[i] > baseline + threshold * mad``  (far outside the recent noise), and
      * ``loss[i] > baseline * (1 + min_jump)``    (a material relative jump, default 5 %),
    or when the loss turns non-finite after a finite history, and the loss then stays above
    the pre-spike band (below) for at least `min_points` consecutive points (default 3: one or
    two bad batches followed at once by normal losses are outliers, not an instability;
    pass 1 to count those too; a loss that turns non-finite inside those points always
    counts). A smoothly decaying curve never triggers: its trailing median
    lies *above* the current loss.

    The spike's pre-spike band is ``baseline + band_k * mad`` (frozen at the start). It is
    *recovered* if, at any later point, `recover_points` consecutive losses all lie inside
    that band; otherwise (a permanent level jump, a divergence, or a spike too close to the
    end of the run to show recovery) it is *unrecovered*.

    After a recovered spike the scan resumes at the recovery point; after an unrecovered one it
    resumes `window` points after the start, once the trailing window holds only post-spike
    points, so a lasting level shift is reported once, not at every step.

    Returns a list of `Spike`, ordered by step.
    """
    s = np.asarray(steps).ravel()
    x = np.asarray(losses, dtype=np.float64).ravel()
    if s.size != x.size:
        raise ValueError(f"detect_spikes: {s.size} steps but {x.size} losses")
    n = x.size
    if n == 0:
        return []
    window = max(int(window), 2)
    min_periods = max(min(int(min_periods), window), 2)
    recover_points = max(int(recover_points), 1)
    med, mad = rolling_median_mad(x, window, min_periods)
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        trigger = (x > med + threshold * mad) & (x > med * (1.0 + min_jump)) & finite
    trigger |= ~finite & np.isfinite(med)

    spikes: list[Spike] = []
    i = 0
    while i < n:
        if not trigger[i]:
            i += 1
            continue
        baseline, noise = float(med[i]), float(mad[i])
        band = baseline + band_k * noise
        held = x[i : i + max(int(min_points), 1)]
        with np.errstate(invalid="ignore"):
            above = np.all(~np.isfinite(held) | (held > band))
            if not above or (held.size < min_points and np.all(np.isfinite(held))):
                i += 1
                continue
        # contiguous run of points still above the detection threshold
        limit = baseline + threshold * noise
        end = i + 1
        while end < n and (not finite[end] or (x[end] > limit and x[end] > baseline * (1.0 + min_jump))):
            end += 1
        segment = x[i:end]
        if np.all(np.isfinite(segment)):
            peak = i + int(np.argmax(segment))
        else:
            peak = i + int(np.argmax(~np.isfinite(segment)))
        # recovery: first stretch of `recover_points` consecutive in-band points after the start
        inside = np.zeros(n, dtype=bool)
        with np.errstate(invalid="ignore"):
            inside[i + 1 :] = finite[i + 1 :] & (x[i + 1 :] <= band)
        recovery = _first_run(inside, i + 1, recover_points)
        spikes.append(
            Spike(
                step=int(s[peak]),
                loss=float(x[peak]),
                baseline=baseline,
                mad=noise,
                band=band,
                start_step=int(s[i]),
                recovered=recovery is not None,
                recovery_step=None if recovery is None else int(s[recovery]),
            )
        )
        i = recovery if recovery is not None else max(end, i + window)
    return spikes


def _first_run(mask: np.ndarray, start: int, length: int) -> Optional[int]:
    """First index j >= start with mask[j : j + length] all True, or None."""
    if start >= mask.size:
        return None
    run = 0
    for j in range(start, mask.size):
        run = run + 1 if mask[j] else 0
        if run >= length:
            return j - length + 1
    return None


# ------------------------------------------------------------------ final loss and noise


def _tail_mask(steps: np.ndarray, tail_fraction: float) -> np.ndarray:
    if steps.size == 0:
        return np.zeros(0, dtype=bool)
    first, last = float(steps[0]), float(steps[-1])
    cut = last - tail_fraction * (last - first)
    mask = steps >= cut
    mask[-1] = True
    return mask


def final_loss(steps: Sequence[int], losses: Sequence[float], tail_fraction: float = 0.1) -> float:
    """Mean of the finite losses logged in the last `tail_fraction` of the run (in steps).

    NaN when the run has no points or its last loss is non-finite (it diverged)."""
    s = np.asarray(steps, dtype=np.float64).ravel()
    x = np.asarray(losses, dtype=np.float64).ravel()
    if x.size == 0 or not np.isfinite(x[-1]):
        return math.nan
    tail = x[_tail_mask(s, tail_fraction)]
    tail = tail[np.isfinite(tail)]
    return float(tail.mean()) if tail.size else math.nan


def tail_noise(steps: Sequence[int], losses: Sequence[float], tail_fraction: float = 0.1) -> float:
    """Noise of a run's final loss estimated from its own curve.

    The standard deviation of the tail's residual around its centered rolling mean (window a
    fifth of the tail, at least 3 points; corrected for the window's own share of each point),
    divided by ``sqrt(n_tail)``: the standard error of `final_loss`, which averages those
    n_tail points. It measures batch-to-batch noise only, not seed-to-seed variation, so it is a
    lower bound on run-to-run noise. NaN with fewer than 4 finite tail points."""
    s = np.asarray(steps, dtype=np.float64).ravel()
    x = np.asarray(losses, dtype=np.float64).ravel()
    tail = x[_tail_mask(s, tail_fraction)] if x.size else x
    tail = tail[np.isfinite(tail)]
    n = tail.size
    if n < 4:
        return math.nan
    w = max(3, n // 5) | 1
    resid = tail - smooth(tail, w, "centered")
    h = w // 2
    inner = resid[h : n - h] if n > 2 * h + 1 else resid  # edges are raw values (zero residual)
    sigma = float(np.std(inner, ddof=1)) / math.sqrt(1.0 - 1.0 / w) if inner.size > 1 else math.nan
    return sigma / math.sqrt(n)


def estimate_noise(
    curves: Mapping[Hashable, tuple[Sequence[int], Sequence[float]]],
    seed_groups: Optional[Iterable[Sequence[Hashable]]] = None,
    tail_fraction: float = 0.1,
    return_source: bool = False,
):
    """Run-to-run noise of the final loss, one number for a set of runs.

    curves: ``{run_id: (steps, losses)}``.
    seed_groups: groups of run ids that differ only by seed. When at least one group has two or
      more runs with a finite final loss, the result is the pooled within-group standard
      deviation of `final_loss` (ddof=1 per group): source ``"seeds"``.
      Otherwise it is the median over runs of `tail_noise`: source ``"curves"`` (batch noise
      only, a lower bound on seed-to-seed variation).
    Returns the noise (NaN when nothing can be estimated), or ``(noise, source)`` with
    `return_source`.
    """
    finals = {k: final_loss(*curves[k], tail_fraction=tail_fraction) for k in curves}
    ss, dof = 0.0, 0
    for group in seed_groups or ():
        vals = np.array([finals[k] for k in group if k in finals], dtype=np.float64)
        vals = vals[np.isfinite(vals)]
        if vals.size >= 2:
            ss += float(np.sum((vals - vals.mean()) ** 2))
            dof += vals.size - 1
    if dof > 0:
        noise, source = math.sqrt(ss / dof), "seeds"
    else:
        per_run = [tail_noise(*curves[k], tail_fraction=tail_fraction) for k in curves]
        per_run = [v for v in per_run if math.isfinite(v)]
        noise, source = (float(np.median(per_run)) if per_run else math.nan), "curves"
    return (noise, source) if return_source else noise


# ------------------------------------------------------------------------------- bands


def convergence_bands(
    final_losses: Mapping[Hashable, float], noise: float, factor: float = 3.0
) -> dict[Hashable, Optional[int]]:
    """Group runs whose final losses are indistinguishable given the noise.

    Runs are sorted by final loss; a new band starts wherever the gap between two consecutive
    runs exceeds ``factor * noise`` (single linkage, so a band may be wider than the threshold
    when runs chain). Returns ``{run_id: band}`` with band 0 the lowest loss; runs whose final
    loss is not finite (failed, diverged) get None.
    """
    if not (isinstance(noise, (int, float)) and math.isfinite(noise) and noise >= 0):
        raise ValueError(f"convergence_bands: noise={noise!r}; need a finite number >= 0")
    threshold = factor * float(noise)
    bands: dict[Hashable, Optional[int]] = {k: None for k in final_losses}
    ranked = sorted(
        ((float(v), k) for k, v in final_losses.items() if v is not None and math.isfinite(float(v))),
        key=lambda t: t[0],
    )
    band, previous = 0, None
    for value, key in ranked:
        if previous is not None and value - previous > threshold:
            band += 1
        bands[key] = band
        previous = value
    return bands


# ------------------------------------------------------------------------------ target


def steps_to_target(
    steps: Sequence[int], losses: Sequence[float], target: float, window: Optional[int] = None, kind: str = "centered"
) -> Optional[int]:
    """First step at which the smoothed loss is <= `target`, or None if it never gets there.

    Smoothing is `smooth(losses, window, kind)`; the default window is 2 % of the points (at
    least 5, odd), and the default centered mean has no lag. Pass ``window=1`` for raw values.
    """
    s = np.asarray(steps).ravel()
    x = np.asarray(losses, dtype=np.float64).ravel()
    if x.size == 0 or target is None or not math.isfinite(float(target)):
        return None
    if window is None:
        window = max(5, int(round(0.02 * x.size))) | 1
    sm = smooth(x, window, kind)
    with np.errstate(invalid="ignore"):
        hit = np.flatnonzero(sm <= float(target))
    return int(s[hit[0]]) if hit.size else None
