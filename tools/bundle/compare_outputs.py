#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Compares one case of gpu_e2e_check.sh: CASE_DIR/cuda_overlap_true, cuda_overlap_false and
cpu_overlap_false, each the .npy outputs of one lossctl compute with inputs of INPUT_DTYPE.
The two CUDA runs must be bit-identical (overlap changes when bytes move, never what is
computed); CUDA against CPU must agree to the tolerance of the input dtype: every output
passes through logits and gradients stored in it, so an fp32 dX or lse of bf16 inputs
carries bf16 rounding. Usage: compare_outputs.py CASE_DIR INPUT_DTYPE. Prints one line per
comparison and exits 1 on any failure."""
import glob
import os
import sys

import numpy as np

# Relative norm error ||a - b|| / ||b|| between two backends' outputs, by input dtype: about
# one unit in the last place of that dtype (bf16 has 8 significant bits, fp16 11, fp32 24),
# the most two roundings of the same logit or gradient can differ by.
REL_NORM_TOL = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-4}
SCALAR_REL_TOL = 1e-4


def load(d):
    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.npy"))):
        out[os.path.basename(f)[:-4]] = np.load(f)
    return out


def as_float(a):
    if a.dtype == np.uint16:  # bf16 bits
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def main(case_dir, input_dtype):
    name = os.path.basename(case_dir.rstrip("/"))
    on = load(os.path.join(case_dir, "cuda_overlap_true"))
    off = load(os.path.join(case_dir, "cuda_overlap_false"))
    cpu = load(os.path.join(case_dir, "cpu_overlap_false"))
    ok = True
    if not on or set(on) != set(off) or set(on) != set(cpu):
        print("FAIL %s: output sets differ: %s / %s / %s" % (name, sorted(on), sorted(off),
                                                          sorted(cpu)))
        return 1
    for t in sorted(on):
        same = on[t].dtype == off[t].dtype and on[t].shape == off[t].shape and \
            on[t].tobytes() == off[t].tobytes()
        print("%s %s %s: cuda overlap vs not: %s" % ("PASS" if same else "FAIL", name, t,
                                                     "bit-identical" if same else "differ"))
        ok &= same
        a, b = as_float(on[t]), as_float(cpu[t])
        if t.startswith("scalars"):
            err = np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30))
            tol = SCALAR_REL_TOL
        elif t == "predictions":
            # argmax may differ where the top two logits tie to within rounding
            err = float(np.mean(a != b))
            tol = 0.01
        else:
            err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            tol = REL_NORM_TOL[input_dtype]
        good = err <= tol
        print("%s %s %s: cuda vs cpu: %.3g (tolerance %.3g)" % ("PASS" if good else "FAIL",
                                                                name, t, err, tol))
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in REL_NORM_TOL:
        sys.exit("usage: compare_outputs.py CASE_DIR bf16|fp16|fp32")
    sys.exit(main(sys.argv[1], sys.argv[2]))
