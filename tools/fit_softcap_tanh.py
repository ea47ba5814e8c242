#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fits the polynomial of kernels/cuda/softcap_tanh.h: tanh(y) = y + y^3 P(y^2) on |y| < 1.

P has degree 6. Each coefficient in turn is fitted for the least maximum relative error of the
result (Lawson's iteratively reweighted least squares on a dense grid, the tanh from mpmath at
40 digits), then rounded to fp32 and held fixed while the remaining ones are refitted, so the
error printed is that of the fp32 coefficients the header uses. Needs numpy and mpmath.
"""
import mpmath as mp
import numpy as np

NEAR, DEGREE = 1.0, 6


def main():
    mp.mp.dps = 40
    y = np.linspace(1e-4, NEAR, 8000)
    t = np.array([float(mp.tanh(mp.mpf(v))) for v in y])
    target = (t - y) / y**3  # what P must equal
    weight = y**3 / t  # P's error times this is the result's relative error
    powers = np.vander(y**2, DEGREE + 1, increasing=True)
    fixed = []
    for k in range(DEGREE + 1):
        rest = target - (powers[:, :k] @ np.array(fixed) if k else 0.0)
        free = powers[:, k:]
        w = np.ones_like(y)
        for _ in range(80):
            sw = np.sqrt(w) * weight
            c, *_ = np.linalg.lstsq(free * sw[:, None], rest * sw, rcond=None)
            err = np.abs((free @ c - rest) * weight)
            w = w * err
            w /= w.sum()
        fixed.append(float(np.float32(c[0])))
    err = np.abs((powers @ np.array(fixed) - target) * weight).max()
    print("max relative error of y + y^3 P(y^2), fp32 coefficients: %.3g" % err)
    for k, c in enumerate(fixed):
        print("c%d = %.9e" % (k, c))


if __name__ == "__main__":
    main()
