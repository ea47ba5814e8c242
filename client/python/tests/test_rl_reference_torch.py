# SPDX-License-Identifier: Apache-2.0
"""The float64 references of the logprob, policy (GRPO/DAPO) and distill (JSD) losses
(kernels/cpu/*_reference.h) against torch autograd implementations of the same formulas, CPU,
float64, on every case kernels/cpu:reference_cases writes (every option combination); and, where
Liger-Kernel 0.8.5's source is importable, against Liger's own chunked GRPO and JSD losses.

Skipped where torch is not installed, or without the reference_cases binary (unless
LOSSD_REFERENCE_CASES names it: then a missing binary is a failure). docs/rl_losses.md has the
formulas.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lossd_servers import find_built_binary

torch = pytest.importorskip("torch")
F = torch.nn.functional

from rl_torch_reference import policy_loss  # noqa: E402

DT = torch.float64


def find_cases_binary():
    return find_built_binary("LOSSD_REFERENCE_CASES", "kernels/cpu", "reference_cases")


@pytest.fixture(scope="module")
def cases():
    out = subprocess.run([find_cases_binary()], capture_output=True, check=True, timeout=300)
    return json.loads(out.stdout)


def t(values, dtype=DT):
    return torch.tensor(values, dtype=dtype)


def head(c, prefix=""):
    """X, W, b (or None) of a case's head as float64 leaves that require grad."""
    h = int(c[prefix + "h"])
    x = t(c[prefix + "x"]).reshape(-1, h).requires_grad_(True)
    w = t(c[prefix + "w"]).reshape(-1, h).requires_grad_(True)
    b = t(c[prefix + "b"]).requires_grad_(True) if c[prefix + "b"] is not None else None
    return x, w, b


def logits(x, w, b, softcap, temperature):
    u = x @ w.T
    if b is not None:
        u = u + b
    if softcap > 0:
        u = softcap * torch.tanh(u / softcap)
    return u / temperature


def expect_close(name, got, want, rtol, atol_of_max):
    """|got - want| <= rtol |want| + atol_of_max max|want|, element-wise, asserted."""
    got = torch.as_tensor(got, dtype=DT).reshape(-1)
    want = torch.as_tensor(want, dtype=DT).reshape(-1)
    assert got.shape == want.shape, name
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs()
    bound = rtol * want.abs() + atol_of_max * scale
    worst = int(torch.argmax(err - bound)) if err.numel() else 0
    assert bool((err <= bound).all()), "%s: worst index %d, got %r want %r (max |want| %g)" % (
        name, worst, got[worst].item(), want[worst].item(), scale)


def expect_grads(c, leaves, rtol, atol):
    x, w, b = leaves
    expect_close("dx", c["dx"], x.grad, rtol, atol)
    expect_close("dw", c["dw"], w.grad, rtol, atol)
    if b is not None:
        expect_close("db", c["db"], b.grad, rtol, atol)
    else:
        assert c["db"] == []


# Both sides are float64 from the same fp32 inputs; they differ only in summation order.
F64_RTOL, F64_ATOL = 1e-10, 1e-12


def test_logprob_matches_torch_autograd(cases):
    assert len(cases["logprob"]) == 16
    for c in cases["logprob"]:
        x, w, b = head(c)
        targets = t(c["targets"], torch.int64)
        keep = targets != c["ignore_index"]
        lp = F.log_softmax(logits(x, w, b, c["softcap"], c["temperature"]), dim=-1)
        logp = lp.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1) * keep
        entropy = -(lp.exp() * lp).sum(-1) * keep
        (t(c["dlogp"]) * logp + t(c["dentropy"]) * entropy).sum().backward()
        expect_close("logp", c["logp"], logp.detach(), F64_RTOL, F64_ATOL)
        expect_close("entropy", c["entropy"], entropy.detach(), F64_RTOL, F64_ATOL)
        expect_grads(c, (x, w, b), F64_RTOL, F64_ATOL)


def torch_policy_loss(c, logp, mask, advantages):
    """Liger-Kernel 0.8.5's GRPO loss (token-level ratios), written from its formulas in
    rl_torch_reference.policy_loss; a case carries the options under the same names."""
    old = t(c["old_logp"]) if c["old_logp"] is not None else None
    ref = t(c["ref_logp"]) if c["ref_logp"] is not None else None
    return policy_loss(logp, mask, advantages, old, ref, c, int(c["batch"]))


def check_policy_case(c):
    x, w, b = head(c)
    targets = t(c["targets"], torch.int64)
    lp = F.log_softmax(logits(x, w, b, c["softcap"], c["temperature"]), dim=-1)
    logp = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    loss, kl, clip = torch_policy_loss(c, logp, t(c["mask"]), t(c["advantages"]))
    loss.backward()
    expect_close("loss", c["loss"], loss.detach(), F64_RTOL, F64_ATOL)
    expect_close("kl", c["kl"], kl if c["has_kl"] else 0.0, F64_RTOL, F64_ATOL)
    expect_close("clip_fraction", c["clip_fraction"], clip, 0, 0)
    expect_grads(c, (x, w, b), F64_RTOL, F64_ATOL)


def test_policy_matches_torch_autograd(cases):
    assert len(cases["policy"]) == 240 and len(cases["policy_ties"]) == 16
    for c in cases["policy"] + cases["policy_ties"]:
        check_policy_case(c)


def test_policy_types_match_torch_autograd(cases):
    """cispo, sapo, luspo, delta and the bias-corrected KL, over every option combination."""
    assert len(cases["policy_types"]) == 288
    assert {c["loss_type"] for c in cases["policy_types"]} == {
        "cispo", "sapo", "luspo", "dapo", "grpo"}
    for c in cases["policy_types"]:
        check_policy_case(c)


def torch_jsd_rows(beta, lq, lp):
    """Liger's generalised JSD per row from the student's (lq) and teacher's (lp) log-probs."""
    q, p = lq.exp(), lp.exp()
    if beta == 0:
        return (p * (lp - lq)).sum(-1)
    if beta == 1:
        return (q * (lq - lp)).sum(-1)
    log_m = torch.logsumexp(torch.stack([lp + torch.log(t(beta)), lq + torch.log(t(1 - beta))]), 0)
    return (beta * p * (lp - log_m) + (1 - beta) * q * (lq - log_m)).sum(-1)


def test_distill_matches_torch_autograd(cases):
    assert len(cases["distill"]) == 48
    for c in cases["distill"]:
        x, w, b = head(c)
        xt, wt, bt = (a.detach() if a is not None else None for a in head(c, "t"))
        lq = F.log_softmax(logits(x, w, b, 0, c["temperature"]), dim=-1)
        lp = F.log_softmax(logits(xt, wt, bt, 0, c["temperature"]), dim=-1)
        rows = torch_jsd_rows(c["jsd_beta"], lq, lp)
        if c["labels"] is not None:
            keep = t(c["labels"], torch.int64) != c["ignore_index"]
        else:
            keep = torch.ones(rows.shape[0], dtype=torch.bool)
        loss = (rows * keep).sum() / keep.sum().clamp(min=1)
        loss.backward()
        expect_close("loss", c["loss"], loss.detach(), F64_RTOL, F64_ATOL)
        expect_grads(c, (x, w, b), F64_RTOL, F64_ATOL)


def import_liger(module):
    """A Liger-Kernel module: installed, or from an unpacked sdist (LIGER_SRC, or where
    tools/liger_check/run.sh unpacks 0.8.5); skips the test where there is none."""
    for src in (os.environ.get("LIGER_SRC"),
                str(Path.home() / ".cache/lossd/liger/liger_kernel-0.8.5/src")):
        if src and Path(src, "liger_kernel").is_dir() and src not in sys.path:
            sys.path.append(src)
    try:
        import importlib
        mod = importlib.import_module(module)
        version = importlib.import_module("liger_kernel")
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        pytest.skip("Liger-Kernel is not importable here: %s" % e)
    del version
    return mod


def compare_with_liger(grpo, c):
    """One case through Liger's own LigerFusedLinearGRPOLoss on CPU (compiled=False). Its
    log-probs are float32 (_selective_logprob_forward), so the comparison allows float32
    rounding: 2e-5 of each output's largest magnitude."""
    bsz = int(c["batch"])
    x, w, b = head(c)
    x3 = x.detach().reshape(bsz, -1, x.shape[1]).requires_grad_(True)
    module = grpo.LigerFusedLinearGRPOLoss(
        beta=c["beta"], compiled=False, use_ref_model=c["ref_logp"] is not None,
        epsilon_low=c["epsilon_low"], epsilon_high=c["epsilon_high"],
        loss_type=c["loss_type"], max_completion_length=int(c["max_completion_length"]),
        temperature=c["temperature"],
        sapo_temperature_pos=c.get("sapo_temperature_pos", 1.0),
        sapo_temperature_neg=c.get("sapo_temperature_neg", 1.05),
        delta=c.get("delta") or None,
        use_bias_correction_kl=bool(c.get("use_bias_correction_kl", False)))
    old = t(c["old_logp"], torch.float32).reshape(bsz, -1) if c["old_logp"] else None
    ref = t(c["ref_logp"], torch.float32).reshape(bsz, -1) if c["ref_logp"] else None
    advantages = t(c["advantages"]).reshape(bsz, -1)[:, 0]  # per sequence in the cases
    loss, metrics = module(
        x3, w, t(c["targets"], torch.int64).reshape(bsz, -1), t(c["mask"]).reshape(bsz, -1),
        advantages, bias=b, ref_per_token_logps=ref, old_per_token_logps=old,
        num_items_in_batch=c["dapo_normalizer"] if c["dapo_normalizer"] > 0 else None)
    loss.backward()
    x.grad = x3.grad.reshape(x.shape)
    tol = 2e-5
    expect_close("loss", c["loss"], loss.detach(), 0, tol)
    if c["has_kl"]:
        expect_close("kl", c["kl"], metrics[0], 0, tol)
    # A float32 metric: a fraction k / N rounded to float32.
    expect_close("clip_fraction", c["clip_fraction"], metrics[-1], 1e-7, 0)
    expect_grads(c, (x, w, b), 0, tol)


def test_policy_matches_liger_grpo(cases):
    """Softcap cases are lossd's own (Liger has no softcap). The tie cases put r = 1 exactly on
    a clip bound (eps 0, no old log-probs)."""
    grpo = import_liger("liger_kernel.chunked_loss.grpo_loss")
    compared = 0
    for c in cases["policy"] + cases["policy_ties"]:
        if c["softcap"] > 0:
            continue
        compare_with_liger(grpo, c)
        compared += 1
    assert compared == 136


def test_policy_types_match_liger_grpo(cases):
    """cispo, sapo, luspo, delta and use_bias_correction_kl through Liger's module. Besides the
    softcap cases, masked luspo cases are left out: Liger's token-level luspo does not multiply
    a token's loss by its own mask, so padding enters its loss (lossd skips masked tokens)."""
    grpo = import_liger("liger_kernel.chunked_loss.grpo_loss")
    compared = 0
    for c in cases["policy_types"]:
        if c["softcap"] > 0 or (c["loss_type"] == "luspo" and min(c["mask"]) == 0):
            continue
        compare_with_liger(grpo, c)
        compared += 1
    assert compared == 120


def test_distill_matches_liger_jsd(cases):
    """Liger's chunked LigerFusedLinearJSDLoss with weight_hard_loss 0 and weight_soft_loss 1
    (its soft loss is LigerFusedLinearJSD's: the same betas, temperature, ignore_index and
    division), on CPU in float64: gradients equal up to summation order, the loss up to the
    float32 scalar Liger accumulates it in. It takes labels always: cases
    without them get labels that ignore nothing."""
    jsd = import_liger("liger_kernel.chunked_loss.jsd_loss")
    for c in cases["distill"]:
        x, w, b = head(c)
        xt, wt, bt = (a.detach() if a is not None else None for a in head(c, "t"))
        if c["labels"] is not None:
            labels = t(c["labels"], torch.int64)
        else:
            labels = torch.zeros(x.shape[0], dtype=torch.int64)
        module = jsd.LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=c["jsd_beta"],
            ignore_index=int(c["ignore_index"]), temperature=c["temperature"], compiled=False)
        loss = module(x, w, xt, wt, labels, b, bt)
        loss.backward()
        # Liger adds the loss into a float32 scalar (loss_acc): float32 rounding there.
        expect_close("loss", c["loss"], loss.detach(), 1e-7, 0)
        expect_grads(c, (x, w, b), F64_RTOL, F64_ATOL)
