# SPDX-License-Identifier: Apache-2.0
"""The naive PyTorch baseline of the loss kinds (bench/kernel/kinds_torch_baseline.py) computes
what it says: each kind's loss and its gradients dX and dW, in fp32 on the CPU at a small shape,
against rl_torch_reference.py's float64 formulas (the oracle of the lossd.rl tests) on the same
random inputs, and its command line runs end to end on the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rl_torch_reference as ref

BENCH = Path(__file__).resolve().parents[3] / "bench" / "kernel"
sys.path.insert(0, str(BENCH))
import kinds_torch_baseline as baseline  # noqa: E402

BT, H, V, T = 24, 16, 70, 0.7


def reference_loss(kind, x, w, inputs):
    """The kind's loss in float64 from rl_torch_reference's formulas."""
    y = inputs.get("y")
    if kind == "cross_entropy":
        return torch.nn.functional.cross_entropy(x @ w.T, y)
    if kind == "logprob":
        logp, entropy = ref.logprob_entropy(x, w, None, y, T)
        return (ref.as64(inputs["dlogp"]) * logp + ref.as64(inputs["dentropy"]) * entropy).sum()
    if kind == "policy":
        logp, _ = ref.logprob_entropy(x, w, None, y, T)
        opts = dict(epsilon_low=baseline.EPS_LOW, epsilon_high=baseline.EPS_HIGH,
                    beta=baseline.BETA, loss_type="dapo", dapo_normalizer=0)
        mask = torch.ones(BT, dtype=ref.DT)
        loss, _, _ = ref.policy_loss(logp, mask, ref.as64(inputs["adv"]), ref.as64(inputs["old"]),
                                     ref.as64(inputs["ref"]), opts, 1)
        return loss
    lq = ref.log_softmax(x, w, None, T)
    lp = ref.log_softmax(ref.as64(inputs["tx"]), ref.as64(inputs["tw"]), None, T)
    return ref.jsd_loss(lq, lp, baseline.JSD_BETA, torch.ones(BT, dtype=ref.DT))


@pytest.mark.parametrize("kind", baseline.KINDS)
def test_loss_and_gradients_match_the_float64_reference(kind):
    dev = torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(7)
    x, w = baseline.head(BT, H, V, dev, gen, torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    temperature = 1.0 if kind == "cross_entropy" else T
    loss_fn, inputs = baseline.make_loss(kind, BT, H, V, x, w, dev, gen, temperature)
    loss = loss_fn()
    loss.backward()

    x64 = ref.as64(x).requires_grad_(True)
    w64 = ref.as64(w).requires_grad_(True)
    want = reference_loss(kind, x64, w64, inputs)
    want.backward()
    assert abs(float(loss.detach()) - float(want.detach())) <= 1e-5 * max(1.0, abs(float(want.detach())))
    for got, exp in ((x.grad, x64.grad), (w.grad, w64.grad)):
        scale = float(exp.abs().max())
        assert scale > 0
        assert float((got.double() - exp).abs().max()) <= 1e-4 * scale


def test_command_line_runs_on_the_cpu():
    out = subprocess.run(
        [sys.executable, str(BENCH / "kinds_torch_baseline.py"), "--device", "cpu", "--shapes",
         "8x4x30", "--runs", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 8, 4, 30 |")]
    assert [line.split("|")[2].strip() for line in rows] == list(baseline.KINDS)


def test_bad_flags_are_refused_naming_them():
    for flags, words in ((["--shapes", "8x4"], "bad shape '8x4'"),
                         (["--kinds", "ce"], "bad --kinds entry 'ce'")):
        res = subprocess.run([sys.executable, str(BENCH / "kinds_torch_baseline.py"), "--dry-run",
                              *flags], capture_output=True, text=True, timeout=120)
        assert res.returncode != 0
        assert words in res.stderr
