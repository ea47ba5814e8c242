#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Mutation check of the policy loss types' tests (cispo, sapo, luspo, delta, the
bias-corrected KL): breaks each formula in turn, in the float64 reference and in the CPU
backend, runs the test that owns it, and requires that test to fail. A mutation the tests
let through is a check that cannot fail.

Usage (from the repository root, no other bazel command running):
  python3 tools/mutation/policy_types.py
Edits the two sources in place and always restores them; exits 1 if any mutation survives
(or does not build).
About 20-40 s of build and test per mutation on two cores.
"""

import subprocess
import sys

REFERENCE = ("kernels/cpu/policy_reference.cc", "//kernels/cpu:policy_reference_types_test")
CPU = ("kernels/cpu/cpu_kinds.cc", "//kernels/cpu:cpu_policy_test")

# (where, what is broken, the text, its replacement)
MUTATIONS = [
    (REFERENCE, "cispo: gradient through the weight", "r.dlogp = -weight * a;",
     "r.dlogp = -r.ratio * a;"),
    (REFERENCE, "cispo: bound 1 + eps_high",
     "const double bound = static_cast<double>(o.epsilon_high);",
     "const double bound = 1.0 + static_cast<double>(o.epsilon_high);"),
    (REFERENCE, "cispo: no clip metric", "r.clipped = r.ratio > bound && a > 0;",
     "r.clipped = false;"),
    (REFERENCE, "sapo: temperatures swapped", "a > 0 ? o.sapo_temperature_pos",
     "a <= 0 ? o.sapo_temperature_pos"),
    (REFERENCE, "sapo: gradient without r", "r.dlogp = -4.0 * a * r.ratio * g * one_minus_g;",
     "r.dlogp = -4.0 * a * g * one_minus_g;"),
    (REFERENCE, "sapo: loss without 4 / tau", "r.loss = -a * 4.0 / tau * g;", "r.loss = -a * g;"),
    (REFERENCE, "luspo: over B, not B S", "/ static_cast<double>(bt);",
     "/ static_cast<double>(p.batch);"),
    (REFERENCE, "luspo: no mask-count weight",
     "w[i] = static_cast<double>(per_seq[i / seq]) / static_cast<double>(bt);",
     "w[i] = 1.0 / static_cast<double>(bt);"),
    (REFERENCE, "delta: cap passes gradient", "if (capped && a < 0) share = 0.0;", ""),
    (REFERENCE, "delta: loss uncapped",
     "const double q = capped ? static_cast<double>(o.delta) : r->ratio;",
     "const double q = r->ratio;"),
    (REFERENCE, "bias-corrected KL: gradient without k3", "dkl = (dkl + k3) * r.ratio;",
     "dkl = dkl * r.ratio;"),
    (REFERENCE, "bias-corrected KL: metric uncorrected", "r.kl = k3 * r.ratio;",
     "r.kl = k3; r.loss += o.beta * k3 * (r.ratio - 1.0);"),
    (CPU, "sapo: temperatures swapped", "a > 0 ? o.sapo_temperature_pos",
     "a <= 0 ? o.sapo_temperature_pos"),
    (CPU, "cispo: bound 1 + eps_high",
     "const double weight = std::min(r, static_cast<double>(o.epsilon_high));",
     "const double weight = std::min(r, 1.0 + o.epsilon_high);"),
    (CPU, "luspo: over B, not B S",
     "w[i] = static_cast<double>(per_seq[i / seq]) / static_cast<double>(bt);",
     "w[i] = static_cast<double>(per_seq[i / seq]) / b;"),
    (CPU, "delta ignored",
     "const bool capped = o.delta != 0.0f && r >= static_cast<double>(o.delta);",
     "const bool capped = false;"),
    (CPU, "bias-corrected KL: gradient without k3", "dkl = (dkl + k3) * r;", "dkl = dkl * r;"),
]


def main():
    survived = 0
    for (path, target), what, text, replacement in MUTATIONS:
        with open(path) as f:
            original = f.read()
        if original.count(text) != 1:
            print("STALE  %s: %s (the text is not in %s once)" % (target, what, path))
            survived += 1
            continue
        try:
            with open(path, "w") as f:
                f.write(original.replace(text, replacement))
            rc = subprocess.run(["bazel", "test", target, "--config=nogpu"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        finally:
            with open(path, "w") as f:
                f.write(original)
        # bazel test: 3 when a test fails; 1 when the build does (a mutation that does not
        # compile proves nothing).
        verdict = {3: "caught  ", 0: "SURVIVED"}.get(rc, "NO BUILD")
        survived += 0 if rc == 3 else 1
        print("%s %s: %s" % (verdict, target, what), flush=True)
    print("%d mutations, %d survived" % (len(MUTATIONS), survived))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
