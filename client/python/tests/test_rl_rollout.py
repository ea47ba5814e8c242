# SPDX-License-Identifier: Apache-2.0
"""lossd.rl's rollout correction (rollout_is_weights, rollout_rejection_mask) against verl's
own compute_rollout_correction_weights and compute_rollout_rejection_mask (read from the
installed verl/trainer/ppo/rollout_corr_helper.py and run with torch and verl's masked_sum /
masked_mean alone, as test_rl_verl.py does; skipped where verl is not installed), against
their formulas written out here (always), and end to end: the weights as is_ratio and the
rejections as ignored targets through a CPU server, against PPO's loss written in float64
torch with the same weights and mask."""

import ast
import importlib.util
import math
import types
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from conftest import assert_close, assert_scalar  # noqa: E402
from lossd.rl import rollout_is_weights, rollout_rejection_mask  # noqa: E402

B, S = 5, 9


def _log_ratio(seed):
    """(B, S) log-ratios from near 0 to past e^+-1, a mask with a short and an empty row."""
    rng = np.random.default_rng(seed)
    lr = rng.choice([-1.3, -0.4, -0.05, 0.02, 0.3, 0.9], size=(B, S)) + rng.uniform(-.03, .03,
                                                                                   (B, S))
    mask = np.ones((B, S), dtype=np.float64)
    mask[1, 5:] = 0
    mask[3, :] = 0
    mask[4, 2] = 0
    return torch.tensor(lr), torch.tensor(mask)


@pytest.fixture(scope="module")
def verl():
    spec = importlib.util.find_spec("verl")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    helper = root / "trainer" / "ppo" / "rollout_corr_helper.py"
    if not helper.exists():
        pytest.skip("this verl has no rollout_corr_helper")
    ns = {"torch": torch, "math": math, "Optional": Optional, "Any": Any}
    tf = ast.parse((root / "utils" / "torch_functional.py").read_text())
    exec(compile(ast.Module(body=[n for n in tf.body if isinstance(n, ast.FunctionDef) and
                                  n.name in ("masked_sum", "masked_mean")], type_ignores=[]),
                 "torch_functional", "exec"), ns)
    ns["verl_F"] = types.SimpleNamespace(masked_sum=ns["masked_sum"],
                                         masked_mean=ns["masked_mean"])
    wanted = {"_parse_rollout_is_threshold", "_parse_rollout_rs_thresholds",
              "compute_rollout_rejection_mask", "compute_rs_metrics",
              "compute_rollout_correction_weights", "compute_is_metrics", "SAFETY_BOUND",
              "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS"}
    body = []
    for node in ast.parse(helper.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            body.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id in wanted:
                body.append(node)
    exec(compile(ast.Module(body=body, type_ignores=[]), str(helper), "exec"), ns)
    missing = [n for n in ("compute_rollout_correction_weights",
                           "compute_rollout_rejection_mask") if n not in ns]
    if missing:
        pytest.skip("verl's rollout_corr_helper lacks %s" % ", ".join(missing))
    return types.SimpleNamespace(**ns)


WEIGHT_CASES = [("token", 2.0, False), ("token", "0.5_2.0", False), ("sequence", 5.0, False),
                ("sequence", "0.05_3.0", False), ("token", 1.5, True), ("sequence", 4.0, True),
                ("token", "0.8_1.2", True)]


@pytest.mark.parametrize("level,threshold,normalize", WEIGHT_CASES)
def test_weights_match_verls(verl, level, threshold, normalize):
    lr, mask = _log_ratio(1)
    want, _ = verl.compute_rollout_correction_weights(lr, mask, rollout_is=level,
                                                      rollout_is_threshold=threshold,
                                                      rollout_is_batch_normalize=normalize)
    got = rollout_is_weights(lr, mask, rollout_is=level, rollout_is_threshold=threshold,
                             rollout_is_batch_normalize=normalize)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-12, atol=0), (got - want).abs().max()


REJECTION_CASES = [("token_k1", "0.5_1.5"), ("token_k1", 2.0), ("token_k2", 0.1),
                   ("token_k3", 0.2), ("seq_sum_k1", "0.3_3.0"), ("seq_sum_k2", 0.5),
                   ("seq_mean_k1", "0.9_1.1"), ("seq_mean_k3", 0.1), ("seq_max_k2", 0.4),
                   ("seq_max_k3", 0.5), ("token_k1,seq_mean_k3", "0.5_2.0,0.1"),
                   ("token_k2,seq_sum_k3", 0.3)]


@pytest.mark.parametrize("options,threshold", REJECTION_CASES)
def test_rejection_matches_verls(verl, options, threshold):
    lr, mask = _log_ratio(2)
    want, _ = verl.compute_rollout_rejection_mask(lr, mask, rollout_rs=options,
                                                  rollout_rs_threshold=threshold)
    got = rollout_rejection_mask(lr, mask, rollout_rs=options, rollout_rs_threshold=threshold)
    assert torch.equal(got, want), (got, want)
    # the case rejects something and keeps something, or it tests nothing
    assert 0 < got.sum() < mask.sum(), options


def test_weights_are_their_formulas():
    lr, mask = _log_ratio(3)
    r = torch.exp(lr) * mask
    assert torch.equal(rollout_is_weights(lr, mask, rollout_is_threshold=1.5),
                       r.clamp(max=1.5))
    ice = rollout_is_weights(lr, mask, rollout_is_threshold="0.7_1.4")
    assert torch.equal(ice, torch.where((r >= 0.7) & (r <= 1.4), r, torch.zeros_like(r)))
    assert 0 < (ice > 0).sum() < (mask > 0).sum()
    seq = rollout_is_weights(lr, mask, rollout_is="sequence", rollout_is_threshold=1e9)
    per_seq = torch.exp((lr * mask).sum(-1, keepdim=True))
    assert torch.allclose(seq, per_seq * mask, rtol=1e-14, atol=0)
    norm = rollout_is_weights(lr, mask, rollout_is_threshold=1.5, rollout_is_batch_normalize=True)
    # mean 1, to verl's 1e-8 in the count it divides by
    assert abs(float((norm * mask).sum() / mask.sum()) - 1.0) < 1e-9


def test_rejection_is_its_formula():
    lr, mask = _log_ratio(4)
    keep = rollout_rejection_mask(lr, mask, rollout_rs="token_k2", rollout_rs_threshold=0.2)
    assert torch.equal(keep, mask * (0.5 * lr.square() <= 0.2))
    seq = rollout_rejection_mask(lr, mask, rollout_rs="seq_max_k3", rollout_rs_threshold=0.5)
    k3 = (torch.exp(lr) - 1 - lr).masked_fill(mask == 0, -1.0).max(-1).values
    assert torch.equal(seq, mask * (k3 <= 0.5).double().unsqueeze(-1))


def test_bad_arguments_are_refused_by_name():
    lr, mask = _log_ratio(5)
    with pytest.raises(lossd.InvalidArgumentError, match="rollout_is must be 'token' or"):
        rollout_is_weights(lr, mask, rollout_is="geometric")
    with pytest.raises(lossd.InvalidArgumentError, match="rollout_is_threshold '2_1'"):
        rollout_is_weights(lr, mask, rollout_is_threshold="2_1")
    with pytest.raises(lossd.InvalidArgumentError, match="rollout_is_threshold must be a num"):
        rollout_is_weights(lr, mask, rollout_is_threshold=True)
    with pytest.raises(lossd.InvalidArgumentError, match="must both be"):
        rollout_is_weights(lr, mask[:, :3])
    with pytest.raises(lossd.InvalidArgumentError, match="rollout_rs must be one or more of"):
        rollout_rejection_mask(lr, mask, rollout_rs="token_k4", rollout_rs_threshold=1.0)
    with pytest.raises(lossd.InvalidArgumentError, match="rollout_rs_threshold is required"):
        rollout_rejection_mask(lr, mask, rollout_rs="token_k2")
    with pytest.raises(lossd.InvalidArgumentError, match="has 3 entries for 2 options"):
        rollout_rejection_mask(lr, mask, rollout_rs="token_k2,seq_sum_k3",
                               rollout_rs_threshold="1,2,3")
    with pytest.raises(lossd.InvalidArgumentError, match="takes one upper bound"):
        rollout_rejection_mask(lr, mask, rollout_rs="token_k3", rollout_rs_threshold="0.1_2")


def test_weights_and_rejections_reach_the_loss(client):
    """The corrected PPO loss through a server: weights as is_ratio, rejected tokens as
    ignored targets, against float64 torch of the same loss."""
    H, V, T = 16, 37, 1.0
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B * S, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) / 3).astype(np.float32)
    ids = rng.integers(0, V, size=(B, S))
    adv = rng.standard_normal((B, S)).astype(np.float32)
    rollout_lr, mask = _log_ratio(6)  # log pi_train(old) - log pi_rollout
    weights = rollout_is_weights(rollout_lr, mask, rollout_is_threshold=1.8).float()
    kept = rollout_rejection_mask(rollout_lr, mask, rollout_rs="token_k1",
                                  rollout_rs_threshold="0.4_2.5")
    assert 0 < kept.sum() < mask.sum()
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    logsm = torch.log_softmax((tx @ tw.T / T).reshape(B, S, V), dim=-1)
    logp = logsm.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
    old = (logp.detach() - torch.tensor(rng.uniform(-0.5, 0.5, (B, S)))).float().double()
    r = torch.exp(logp - old)
    a = torch.tensor(adv, dtype=torch.float64)
    pg = torch.maximum(-a * r, -a * torch.clamp(r, 0.8, 1.28)) * weights.double()
    loss = (pg * kept).sum() / kept.sum()
    loss.backward()
    targets = np.where(kept.numpy() > 0, ids, -100).reshape(-1)
    policy = lossd.PolicyOptions(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, beta=0.0,
                                 sequences=B)
    res = client.compute(x, w, targets, kind="policy", temperature=T,
                         advantages=adv.reshape(-1), old_logp=old.float().numpy().reshape(-1),
                         is_ratio=weights.numpy().reshape(-1), policy=policy)
    assert_scalar("loss", res.loss, float(loss.detach()), "fp32")
    assert_close("dx", res.dx, tx.grad.numpy(), "fp32")
    assert_close("dw", res.dw, tw.grad.numpy(), "fp32")
