"""Synthetic study points drawn from known scaling laws, for the fit tests."""

import math

import numpy as np

from ropelab.study.fit import Point

E, A, ALPHA, B, BETA = 1.8, 50.0, 0.35, 30.0, 0.3
BUDGETS = np.geomspace(1e5, 1e7, 8)
PARAMS = 1e5
NOISE = 0.002  # multiplicative, 0.2 %
RESAMPLES = 200


def data_law(tokens, offset: float = 0.0):
    return E + offset + B * np.asarray(tokens) ** -BETA


def joint_law(params, tokens):
    return E + A * np.asarray(params) ** -ALPHA + B * np.asarray(tokens) ** -BETA


def points(variant: str = "rope", offset: float = 0.0, seeds=(0, 1), sizes=(PARAMS,), noise_seed: int = 0,
           law=None) -> list[Point]:
    rng = np.random.default_rng(noise_seed)
    law = law or (lambda n, d: data_law(d, offset))
    return [Point(variant, seed, n, float(d), float(law(n, d) * math.exp(NOISE * rng.standard_normal())))
            for seed in seeds for n in sizes for d in BUDGETS]
