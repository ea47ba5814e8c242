# SPDX-License-Identifier: Apache-2.0
"""The policy kind's verl menu (KL estimators and their straight-through variants, the entropy
bonus, the four aggregation modes with verl's global counts and loss_scale_factor, dual-clip
PPO, gpg, geo_mean with and without rollout weights, kl_cov) through a CPU server and lossd.verl_policy_options, against two oracles applied to
float64 autograd log-probs of the same head: the formulas written out below in torch float64
(always), and verl's own torch functions from the installed package
(verl.trainer.ppo.core_algos: kl_penalty, agg_loss, compute_policy_loss_vanilla,
compute_policy_loss_gpg, compute_policy_loss_geo_mean, compute_policy_loss_kl_cov) where
verl is installed.

verl's package __init__ imports ray and its core_algos imports verl's configs; neither is
needed here, so the functions' source is read from the installed file and run with torch and
verl's own masked_sum / masked_mean (from verl/utils/torch_functional.py), nothing else.
Skipped where torch is not installed (the verl cases where verl is not)."""

import ast
import importlib.util
import types
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from conftest import assert_close, assert_scalar  # noqa: E402

B, S, H, V, T = 3, 8, 24, 61, 0.9


def _functions(path, names, namespace):
    """Runs the top-level functions `names` of the file at `path` in `namespace`, decorators
    dropped (verl's register_policy_loss, deprecated)."""
    tree = ast.parse(Path(path).read_text())
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            found.append(node)
    missing = set(names) - {n.name for n in found}
    if missing:
        pytest.skip("verl's core_algos lacks %s" % ", ".join(sorted(missing)))
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


class _Formulas:
    """verl's formulas in float64 torch, written from its documented definitions: d = logp -
    ref; k1 d, abs |d|, k2 d^2/2, low_var_kl clamp(e^x - x - 1, +-10) at x = clamp(-d, +-20),
    '+' the value with k2's gradient; PPO's clipped ratio with the dual clip c where A < 0;
    gpg -A logp; geo_mean (GMPO) the mean over sequences of -mean(A) exp(mean of the
    log-ratios clipped on A's side), the rollout weights' geometric mean beside; GSPO's
    sequence ratio (the paper's: exp of the masked mean log-ratio, its gradient through the
    mean, log-ratio capped at 10) clipped as PPO's; SAPO's gate sigmoid(tau (r - 1)) 4 / tau,
    tau by A's sign, always by seq-mean-token-mean; CISPO's -sg(clamp(r, 1 - low, 1 + high)) A
    logp; the modes over the masked (B, S) matrix with verl's global counts."""

    @staticmethod
    def kl_penalty(logp, ref, kind):
        base = kind.rstrip("+")
        d = logp - ref
        x = torch.clamp(-d, -20, 20)
        low_var = torch.clamp(x.exp() - x - 1, -10, 10)
        value = {"kl": d, "k1": d, "abs": d.abs(), "mse": d * d / 2, "k2": d * d / 2,
                 "low_var_kl": low_var, "k3": low_var}[base]  # verl's k3 is low_var_kl
        if kind.endswith("+"):
            k2 = d * d / 2
            return k2 - k2.detach() + value.detach()
        return value

    @staticmethod
    def agg_loss(mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                 loss_scale_factor=None):
        per_seq = (mat * mask).sum(-1)
        counts = mask.sum(-1)
        kept = (counts > 0).double()
        if mode == "token-mean":
            n = mask.sum() if batch_num_tokens is None else batch_num_tokens
            return per_seq.sum() / n * dp_size
        g = kept.sum() if global_batch_size is None else global_batch_size
        if mode == "seq-mean-token-mean":
            return (per_seq / counts.clamp(min=1) * kept).sum() / g * dp_size
        loss = (per_seq * kept).sum() / g * dp_size
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss

    @classmethod
    def compute_policy_loss_vanilla(cls, old, logp, a, mask, mode, config):
        r = torch.exp(torch.clamp(logp - old, -20, 20))
        clipped = torch.clamp(r, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        pg = torch.maximum(-a * r, -a * clipped)
        pg = torch.where(a < 0, torch.minimum(pg, -a * config.clip_ratio_c), pg)
        return cls.agg_loss(pg, mask, mode, **config.global_batch_info), {}

    @classmethod
    def compute_policy_loss_gspo(cls, old, logp, a, mask, mode, config):
        n = mask.sum(-1, keepdim=True).clamp(min=1)
        r = torch.exp(torch.clamp(((logp - old) * mask).sum(-1, keepdim=True) / n, max=10.0))
        clipped = torch.clamp(r, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        pg = torch.maximum(-a * r, -a * clipped)
        return cls.agg_loss(pg, mask, mode, **config.global_batch_info), {}

    @classmethod
    def compute_policy_loss_cispo(cls, old, logp, a, mask, mode, config, rollout_is_weights=None):
        r = torch.exp(logp - old)
        weight = torch.clamp(r, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high).detach()
        pg = -weight * a * logp
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights
        return cls.agg_loss(pg, mask, mode, **config.global_batch_info), {}

    @classmethod
    def compute_policy_loss_sapo(cls, old, logp, a, mask, mode, config):
        r = torch.exp(torch.clamp(logp - old, -20, 20))
        tau = torch.where(a > 0, torch.full_like(a, config.tau_pos),
                          torch.full_like(a, config.tau_neg))
        pg = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
        return cls.agg_loss(pg, mask, "seq-mean-token-mean", **config.global_batch_info), {}

    @classmethod
    def compute_policy_loss_gpg(cls, old, logp, a, mask, mode, config):
        return cls.agg_loss(-a * logp, mask, mode, **config.global_batch_info), {}

    @staticmethod
    def compute_policy_loss_geo_mean(old, logp, a, mask, mode, config, rollout_is_weights=None):
        d = logp - old
        s = torch.sign(a)
        e = s * torch.minimum(s * d, s * torch.clamp(d, -config.clip_ratio_low,
                                                     config.clip_ratio_high))
        n = mask.sum(-1)
        pg = -((a * mask).sum(-1) / n) * torch.exp((e * mask).sum(-1) / n)
        if rollout_is_weights is not None:
            pg = pg * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(-1) / n)
        return pg.mean(), {}

    @classmethod
    def compute_policy_loss_kl_cov(cls, old, logp, a, mask, mode, config, rollout_is_weights=None):
        d = logp - old
        r = torch.exp(d)
        valid = mask > 0
        la, ll = a[valid].detach(), logp[valid].detach()
        cov = torch.full_like(a, float("-inf"))
        cov[valid] = (la - la.mean()) * (ll - ll.mean())
        k = max(1, int(la.numel() * config.policy_loss.kl_cov_ratio))
        chosen = torch.zeros(a.numel(), dtype=torch.bool)
        chosen[torch.topk(cov.reshape(-1), k).indices] = True
        pg = -a * r + chosen.reshape(a.shape) * config.policy_loss.ppo_kl_coef * d.abs()
        if rollout_is_weights is not None:
            pg = pg * rollout_is_weights
        return cls.agg_loss(pg, mask, mode, **config.global_batch_info), {}


@pytest.fixture(scope="module", params=["formulas", "verl"])
def verl(request):
    if request.param == "formulas":
        return _Formulas
    spec = importlib.util.find_spec("verl")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    root = Path(list(spec.submodule_search_locations)[0])
    tf = _functions(root / "utils" / "torch_functional.py", ["masked_sum", "masked_mean"],
                    {"torch": torch, "Optional": Optional})
    verl_f = types.SimpleNamespace(masked_sum=tf["masked_sum"], masked_mean=tf["masked_mean"])

    class AlgoConfig:  # what the functions' isinstance checks compare against
        pass

    ns = {"torch": torch, "verl_F": verl_f, "Optional": Optional, "Any": Any,
          "AlgoConfig": AlgoConfig, "ActorConfig": object, "DictConfig": object}
    return types.SimpleNamespace(**_functions(
        root / "trainer" / "ppo" / "core_algos.py",
        ["kl_penalty", "kl_penalty_forward", "agg_loss", "compute_policy_loss_vanilla",
         "compute_policy_loss_gpg", "compute_policy_loss_geo_mean",
         "compute_policy_loss_kl_cov", "compute_policy_loss_gspo",
         "compute_policy_loss_sapo", "compute_policy_loss_cispo"], ns))


class _Config(dict):
    """verl's ActorConfig as its policy losses read it."""

    def __getattr__(self, name):
        return self[name]


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B * S, H)).astype(np.float32)
    w = (rng.standard_normal((V, H)) / 3).astype(np.float32)
    ids = rng.integers(0, V, size=(B, S))
    mask = np.ones((B, S), dtype=bool)
    mask[0, 6:] = False  # a shorter completion
    mask[2, 3] = False
    adv = rng.standard_normal((B, S)).astype(np.float32)
    # log-ratios over both clip bounds, and a few beyond the dual clip's 3 with A < 0
    log_r = rng.choice([-0.6, -0.05, 0.05, 0.5, 1.4], size=(B, S)) + rng.uniform(-.02, .02, (B, S))
    ref_d = rng.uniform(-0.6, 0.6, size=(B, S))
    return x, w, ids, mask, adv, log_r, ref_d


def _reference(verl, seed, opts):
    """verl's loss on float64 autograd log-probs; returns the inputs lossd gets and the loss,
    dX, dW."""
    x, w, ids, mask, adv, log_r, ref_d = _inputs(seed)
    tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    logits = (tx @ tw.T / T).reshape(B, S, V)
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    old = (logp.detach() - torch.tensor(log_r)).float().double()  # as sent: fp32
    ref = (logp.detach() + torch.tensor(ref_d)).float().double()
    if opts.get("sequence_advantages"):  # GRPO's: one per sequence, repeated over its tokens
        adv = np.repeat(adv[:, :1], S, axis=1)
    m = torch.tensor(mask, dtype=torch.float64)
    a = torch.tensor(adv, dtype=torch.float64)
    mode = opts["loss_agg_mode"]
    info = opts.get("global_batch_info", {})
    config = _Config(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                     clip_ratio_c=opts.get("clip_ratio_c", 3.0), global_batch_info=info,
                     policy_loss=_Config(kl_cov_ratio=opts.get("kl_cov_ratio", 0.0002),
                                         ppo_kl_coef=opts.get("ppo_kl_coef", 1.0)),
                     tau_pos=opts.get("tau_pos", 1.0), tau_neg=opts.get("tau_neg", 1.05))
    rho = None
    if opts.get("is_ratio"):  # rollout correction weights, per token
        rho = np.random.default_rng(seed + 1).uniform(0.2, 2.0, (B, S)).astype(np.float32)
    if opts["policy_loss"] == "geo_mean":
        pg, _ = verl.compute_policy_loss_geo_mean(
            old, logp, a, m, mode, config,
            rollout_is_weights=None if rho is None else torch.tensor(rho, dtype=torch.float64))
    elif opts["policy_loss"] == "kl_cov":
        pg, _ = verl.compute_policy_loss_kl_cov(
            old, logp, a, m, mode, config,
            rollout_is_weights=None if rho is None else torch.tensor(rho, dtype=torch.float64))
    elif opts["policy_loss"] == "gpg":
        pg, _ = verl.compute_policy_loss_gpg(old, logp, a, m, mode, config)
    elif opts["policy_loss"] == "gspo":
        pg, _ = verl.compute_policy_loss_gspo(old, logp, a, m, mode, config)
    elif opts["policy_loss"] == "sapo":
        pg, _ = verl.compute_policy_loss_sapo(old, logp, a, m, mode, config)
    elif opts["policy_loss"] == "cispo":
        pg, _ = verl.compute_policy_loss_cispo(
            old, logp, a, m, mode, config,
            rollout_is_weights=None if rho is None else torch.tensor(rho, dtype=torch.float64))
    else:
        pg, _ = verl.compute_policy_loss_vanilla(old, logp, a, m, mode, config)
    loss = pg
    if opts.get("kl_loss_coef", 0):
        kld = verl.kl_penalty(logp, ref, opts["kl_loss_type"])
        loss = loss + opts["kl_loss_coef"] * verl.agg_loss(kld, m, mode, **info)
    if opts.get("entropy_coeff", 0):
        loss = loss - opts["entropy_coeff"] * verl.agg_loss(entropy, m, mode, **info)
    loss.backward()
    targets = np.where(mask, ids, -100).reshape(-1)
    sent = dict(x=x, w=w, targets=targets, advantages=adv.reshape(-1),
                old_logp=old.float().numpy().reshape(-1), ref_logp=ref.float().numpy().reshape(-1),
                is_ratio=None if rho is None else rho.reshape(-1))
    return sent, float(loss.detach()), tx.grad.numpy(), tw.grad.numpy()


CASES = [
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
         kl_loss_coef=0.1, entropy_coeff=0.01),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-sum", kl_loss_type="k1",
         kl_loss_coef=0.2),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k2",
         kl_loss_coef=0.3, entropy_coeff=0.05),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="abs",
         kl_loss_coef=0.1),
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", kl_loss_type="k3+",
         kl_loss_coef=0.2, clip_ratio_c=2.0),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k1+",
         kl_loss_coef=0.2),
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", kl_loss_type="abs+",
         kl_loss_coef=0.2, entropy_coeff=0.02),
    dict(policy_loss="gpg", loss_agg_mode="token-mean", kl_loss_type="kl", kl_loss_coef=0.1),
    dict(policy_loss="gpg", loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="mse",
         kl_loss_coef=0.1, entropy_coeff=0.03),
    # geo_mean: its own mean over the sequences, loss_agg_mode aggregating the KL and entropy
    dict(policy_loss="geo_mean", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
         kl_loss_coef=0.1, entropy_coeff=0.01),
    dict(policy_loss="geo_mean", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k2",
         kl_loss_coef=0.2, is_ratio=True),
    # kl_cov: a fifth of the tokens penalised (verl's 0.0002 picks one of these 21)
    dict(policy_loss="kl_cov", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
         kl_loss_coef=0.1, kl_cov_ratio=0.2, ppo_kl_coef=0.5),
    dict(policy_loss="kl_cov", loss_agg_mode="seq-mean-token-sum", kl_loss_type="k1",
         kl_loss_coef=0.1, entropy_coeff=0.02, is_ratio=True),
    # gspo: sequence-level ratios, GRPO's per-sequence advantages (with per-token ones verl's
    # stop-gradient form gives each token its own share, lossd the sequence's mean)
    dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", kl_loss_type="low_var_kl",
         kl_loss_coef=0.1, entropy_coeff=0.01, sequence_advantages=True),
    dict(policy_loss="gspo", loss_agg_mode="token-mean", kl_loss_type="k1", kl_loss_coef=0.2,
         sequence_advantages=True),
    # sapo: its gate temperatures; its term by seq-mean-token-mean whatever loss_agg_mode says
    dict(policy_loss="sapo", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k2",
         kl_loss_coef=0.1, entropy_coeff=0.02, tau_pos=1.3, tau_neg=0.7),
    dict(policy_loss="sapo", loss_agg_mode="token-mean", kl_loss_type="k1", kl_loss_coef=0.0),
    # cispo: the detached weight clamped on both sides (lossd's cispo_clamp)
    dict(policy_loss="cispo", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
         kl_loss_coef=0.1, entropy_coeff=0.01),
    dict(policy_loss="cispo", loss_agg_mode="seq-mean-token-sum", kl_loss_type="k2",
         kl_loss_coef=0.2, is_ratio=True),
    # one data-parallel rank of two: verl's global counts (the whole batch's), lossd's
    # dapo_normalizer = count / dp_size; and a fixed loss_scale_factor
    dict(policy_loss="vanilla", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
         kl_loss_coef=0.1, entropy_coeff=0.01,
         global_batch_info=dict(dp_size=2, batch_num_tokens=44)),
    dict(policy_loss="vanilla", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k1",
         kl_loss_coef=0.2, global_batch_info=dict(dp_size=2, global_batch_size=7)),
    dict(policy_loss="gpg", loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="abs",
         kl_loss_coef=0.1, global_batch_info=dict(dp_size=2, global_batch_size=5,
                                                  loss_scale_factor=13)),
]


def _global_normalizer(opts):
    info = opts.get("global_batch_info", {})
    count = info.get("batch_num_tokens" if opts["loss_agg_mode"] == "token-mean"
                     else "global_batch_size")
    return 0.0 if count is None else count / info.get("dp_size", 1)


@pytest.mark.parametrize("opts", CASES, ids=lambda o: "%s_%s_%s%s%s" % (
    o["policy_loss"], o["loss_agg_mode"], o["kl_loss_type"],
    "_entropy" if o.get("entropy_coeff") else "", "_global" if "global_batch_info" in o else "")
    + ("_is_ratio" if o.get("is_ratio") else ""))
def test_policy_matches_verls_functions(verl, client, opts):
    sent, loss, dx, dw = _reference(verl, 5, opts)
    policy = lossd.verl_policy_options(
        policy_loss=opts["policy_loss"], clip_ratio=0.2, clip_ratio_high=0.28,
        clip_ratio_c=opts.get("clip_ratio_c", 3.0), loss_agg_mode=opts["loss_agg_mode"],
        kl_loss_type=opts["kl_loss_type"], kl_loss_coef=opts["kl_loss_coef"],
        entropy_coeff=opts.get("entropy_coeff", 0.0), sequences=B,
        global_normalizer=_global_normalizer(opts),
        loss_scale_factor=opts.get("global_batch_info", {}).get("loss_scale_factor"),
        kl_cov_ratio=opts.get("kl_cov_ratio", 0.0002), ppo_kl_coef=opts.get("ppo_kl_coef", 1.0),
        tau_pos=opts.get("tau_pos", 1.0), tau_neg=opts.get("tau_neg", 1.05))
    r = client.compute(sent["x"], sent["w"], sent["targets"], kind="policy", temperature=T,
                       advantages=sent["advantages"], old_logp=sent["old_logp"],
                       ref_logp=sent["ref_logp"], is_ratio=sent["is_ratio"], policy=policy)
    assert_scalar("loss", r.loss, loss, "fp32")
    assert_close("dx", r.dx, dx, "fp32")
    assert_close("dw", r.dw, dw, "fp32")


def test_dual_clip_caps_negative_advantages(verl, client):
    """The dual clip changes the loss here (some A < 0 tokens have r above clip_ratio_c), so
    the case above checks it and not a no-op."""
    opts = dict(policy_loss="vanilla", loss_agg_mode="token-mean", kl_loss_type="kl")
    _, capped, _, _ = _reference(verl, 5, dict(opts, clip_ratio_c=2.0))
    _, loose, _, _ = _reference(verl, 5, dict(opts, clip_ratio_c=1e9))
    assert capped < loose - 1e-3


def test_verl_names_that_are_not_built_are_refused():
    with pytest.raises(lossd.InvalidArgumentError, match="verl policy_loss 'clip_cov' is not"):
        lossd.verl_policy_options(policy_loss="clip_cov")
    with pytest.raises(lossd.InvalidArgumentError, match="kl_loss_type must be one of"):
        lossd.verl_policy_options(kl_loss_type="full")
    with pytest.raises(lossd.InvalidArgumentError, match="loss_agg_mode must be one of"):
        lossd.verl_policy_options(loss_agg_mode="token-sum")
    p = lossd.verl_policy_options(kl_loss_type="k3+", loss_agg_mode="seq-mean-token-sum-norm",
                                  loss_scale_factor=4096)
    assert (p.kl_estimator, p.kl_straight_through, p.delta, p.loss_scale_factor) == (
        "low_var_kl", True, 3.0, 4096)
    g = lossd.verl_policy_options(policy_loss="geo_mean", clip_ratio=0.4)
    assert (g.loss_type, g.epsilon_low, g.epsilon_high, g.delta) == ("geo_mean", 0.4, 0.4, None)
    q = lossd.verl_policy_options(policy_loss="gspo")
    assert (q.loss_type, q.importance_sampling, q.delta) == ("dapo", "sequence", None)
    with pytest.raises(lossd.InvalidArgumentError, match="verl's sapo aggregates its term by "
                                                         "seq-mean-token-mean"):
        lossd.verl_policy_options(policy_loss="sapo", kl_loss_coef=0.1)


def test_unknown_option_values_are_refused_before_sending(client):
    x, w, ids, mask, adv, _, _ = _inputs(3)
    for field, value in (("kl_estimator", "k4"), ("aggregation", "token-sum")):
        with pytest.raises(lossd.InvalidArgumentError, match="policy.%s must be one of" % field):
            client.compute(x, w, ids.reshape(-1), kind="policy", advantages=adv.reshape(-1),
                           policy={field: value})


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+",
                                  "abs+", "k2+", "low_var_kl+", "k3+"])
def test_kl_penalty_matches_verls(verl, name):
    """lossd.rl.verl_kl_penalty, the per-token estimate as its own output, against verl's
    kl_penalty: the values and both arguments' gradients in float64, over log-ratios that reach
    low_var_kl's clamps (|d| > 20 and e^x - x - 1 > 10) on some tokens."""
    from lossd import rl

    rng = np.random.default_rng(11)
    d = rng.standard_normal((B, S)) * 2.0
    d[0, :3] = [25.0, -25.0, -13.0]  # both clamps of x, and the value's
    base = rng.standard_normal((B, S)) - 3.0
    got_lp = torch.tensor(base + d, dtype=torch.float64, requires_grad=True)
    got_ref = torch.tensor(base, dtype=torch.float64, requires_grad=True)
    want_lp = got_lp.detach().clone().requires_grad_(True)
    want_ref = got_ref.detach().clone().requires_grad_(True)
    got = rl.verl_kl_penalty(got_lp, got_ref, name)
    want = verl.kl_penalty(want_lp, want_ref, name)
    assert got.shape == want.shape == (B, S)
    assert_close("kl", got.detach().numpy(), want.detach().numpy(), "fp64")
    upstream = torch.tensor(rng.standard_normal((B, S)))
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert_close("dlogp", got_lp.grad.numpy(), want_lp.grad.numpy(), "fp64")
    assert_close("dref", got_ref.grad.numpy(), want_ref.grad.numpy(), "fp64")
    assert float(got_lp.grad.abs().sum()) > 0


def test_kl_penalty_refuses_unknown_names_and_shapes():
    from lossd import rl

    x = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(lossd.InvalidArgumentError, match="kl_penalty must be one of"):
        rl.verl_kl_penalty(x, x, "full")
    with pytest.raises(lossd.InvalidArgumentError, match="logp has shape"):
        rl.verl_kl_penalty(x, torch.zeros(4, dtype=torch.float64), "kl")
