# SPDX-License-Identifier: Apache-2.0
"""The loss kinds in torch float64 autograd, written from docs/rl_losses.md (the same formulas
test_rl_reference_torch.py checks the float64 references against): the oracle of the
lossd.rl tests. And ReferenceClient: a stand-in for lossd.Client whose compute() answers
the kinds with these formulas, so the torch modules' plumbing (shapes, which tensors are sent,
the upstream gradient's scaling, metrics, the two-phase log-prob's tickets) is tested without
a server."""

import itertools
import types

import lossd

import numpy as np
import torch

F = torch.nn.functional
DT = torch.float64


def as64(value):
    """A tensor / ndarray as a float64 torch tensor (detached copy)."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, dtype=np.float64))
    return value.detach().to("cpu", DT).clone()


def log_softmax(x, w, b, temperature):
    z = x @ w.T
    if b is not None:
        z = z + b
    return F.log_softmax(z / temperature, dim=-1)


def logprob_entropy(x, w, b, targets, temperature, ignore_index=-100):
    """(logp, entropy) per row; 0 on rows whose target is ignore_index."""
    lp = log_softmax(x, w, b, temperature)
    keep = targets != ignore_index
    logp = lp.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1) * keep
    entropy = -(lp.exp() * lp).sum(-1) * keep
    return logp, entropy


def policy_loss(logp, mask, adv, old, ref, opts, bsz, is_ratio=None):
    """Liger-Kernel 0.8.5's GRPO loss: (loss, mean KL, clip fraction); token-level ratios, or
    with opts["importance_sampling"] == "sequence" one per sequence (GSPO: the exp of the mean
    of its masked log-ratios). opts: the PolicyOptions fields (a dict; the fields past
    dapo_normalizer may be absent)."""
    logp, mask, adv = (a.reshape(bsz, -1) for a in (logp, mask, adv))
    old = old.reshape(bsz, -1) if old is not None else logp.detach()
    ref = ref.reshape(bsz, -1) if ref is not None else logp.detach()
    lo, hi = 1 - opts["epsilon_low"], 1 + opts["epsilon_high"]
    kind = opts["loss_type"]
    coef1 = torch.exp(logp - old)
    if opts.get("importance_sampling", "token") == "sequence":
        mean = ((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(
            min=1.0)
        coef1 = torch.exp(mean).expand_as(logp)
    if kind == "cispo":  # the weight min(r, eps_high) detached; the bound is eps_high itself
        weight = torch.clamp(coef1, max=opts["epsilon_high"]).detach()
        per_token = -weight * adv * logp
        clipped = (coef1 > opts["epsilon_high"]) & (adv > 0)
    elif kind == "sapo":
        def gate(tau):
            return torch.sigmoid(tau * (coef1 - 1)) * 4 / tau
        per_token = -torch.where(adv > 0, gate(opts.get("sapo_temperature_pos", 1.0)),
                                 gate(opts.get("sapo_temperature_neg", 1.05))) * adv
        clipped = torch.zeros_like(adv, dtype=torch.bool)
    elif kind == "vespo":  # Liger's get_gamma_weights, detached; vllm_is_ratio inside it
        floor = float(np.log(1e-8))
        u = (torch.clamp(logp - old, -20.0, 20.0) * mask).sum(-1, keepdim=True)
        if is_ratio is not None:  # every token's, masked or not; a (B, 1) one once
            u = u + torch.clamp(torch.log(is_ratio.reshape(bsz, -1)), floor, 20.0).sum(
                -1, keepdim=True)
        log_w = torch.clamp(u, floor, 20.0)
        pos = adv >= 0
        k = torch.where(pos, opts.get("vespo_k_pos", 2.0), opts.get("vespo_k_neg", 3.0))
        lam = torch.where(pos, opts.get("vespo_lambda_pos", 3.0),
                          opts.get("vespo_lambda_neg", 2.0)).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()
        per_token = -phi * adv * logp
        clipped = torch.zeros_like(adv, dtype=torch.bool)
    else:
        coef2 = torch.clamp(coef1, lo, hi)
        capped = torch.clamp(coef1, max=opts["delta"]) if opts.get("delta") else coef1
        per_token = -torch.min(capped * adv, coef2 * adv)
        clipped = ((coef1 < lo) & (adv < 0)) | ((coef1 > hi) & (adv > 0))
    if is_ratio is not None and kind != "vespo":  # on the policy term before the KL term
        per_token = per_token * is_ratio.reshape(bsz, -1)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    if opts.get("use_bias_correction_kl"):
        kl = kl * coef1
    if opts["beta"] != 0:
        per_token = per_token + opts["beta"] * kl
    n = mask.sum().clamp(min=1.0)
    if kind in ("grpo", "sapo"):
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / bsz
    elif kind == "bnpo":
        loss = (per_token * mask).sum() / n
    elif kind == "dr_grpo":
        loss = (per_token * mask).sum() / (bsz * opts["max_completion_length"])
    elif kind == "luspo":  # each token times its sequence's mask count, over B S
        loss = (per_token * mask * mask.sum(-1, keepdim=True)).sum() / mask.numel()
    else:  # dapo, cispo, vespo
        d = opts["dapo_normalizer"] if opts["dapo_normalizer"] > 0 else mask.sum()
        loss = (per_token * mask).sum() / torch.clamp(torch.as_tensor(d, dtype=DT), min=1.0)
    return loss, (kl.detach() * mask).sum() / n, (clipped * mask).sum() / n


def jsd_loss(lq, lp, beta, keep):
    """Liger's generalised JSD of student (lq) and teacher (lp) log-probs over kept rows."""
    q, p = lq.exp(), lp.exp()
    if beta == 0:
        rows = (p * (lp - lq)).sum(-1)
    elif beta == 1:
        rows = (q * (lq - lp)).sum(-1)
    else:
        log_m = torch.logsumexp(torch.stack([lp + np.log(beta), lq + np.log(1 - beta)]), 0)
        rows = (beta * p * (lp - log_m) + (1 - beta) * q * (lq - log_m)).sum(-1)
    return (rows * keep).sum() / keep.sum().clamp(min=1)


def hard_loss(x, w, b, labels, keep):
    """LigerFusedLinearJSDLoss's hard term: the labels' cross-entropy of the logits at
    temperature 1, summed over kept rows over their count."""
    logp, _ = logprob_entropy(x, w, b, torch.where(keep, labels, -100), 1.0)
    return -logp.sum() / keep.sum().clamp(min=1)


class ReferenceClient:
    """compute() of the loss kinds in float64 torch autograd; results as lossd's (numpy).

    The two-phase log-prob as the server's contract has it: a logprob forward with keep_ms
    keeps its inputs under a ticket (in `tickets`; no expiry: a test drops them to expire
    them), a compute naming a ticket computes from them and consumes it, and one naming a
    ticket not held is NotFoundError. features: what require_feature finds."""

    def __init__(self, features=("logprob_two_phase", "policy_sequence_importance_sampling",
                                 "policy_is_ratio", "distill_hard_loss")):
        self.calls = []  # the keyword arguments of every compute
        self.features = set(features)
        self.tickets = {}  # ticket -> the forward's (x, w, targets, bias, temperature)
        self._ids = itertools.count(1)

    def require_feature(self, name, *, timeout=None):
        if name not in self.features:
            raise lossd.UnimplementedError("the reference client lacks %r" % name)

    def compute(self, x, w, targets, *, keep_ms=0, ticket=None, **kw):
        if ticket is not None:
            assert x is None and w is None and targets is None and "bias" not in kw, \
                "a ticket's backward sends no X, W, bias or targets"
            if ticket not in self.tickets:
                raise lossd.NotFoundError("ticket %r is not held" % ticket, method="Compute")
            x, w, targets, bias, temperature = self.tickets.pop(ticket)
            assert kw.get("temperature") is None, "a backward leaves the temperature unset"
            kw.update(bias=bias, temperature=temperature)
        # Called inside autograd Functions, where grad mode is off.
        with torch.enable_grad():
            res = self._compute(x, w, targets, **kw)
        self.calls[-1].update(keep_ms=keep_ms, ticket=ticket)
        if keep_ms:
            assert kw.get("kind") == "logprob" and kw.get("dlogp") is None, "a keeping forward"
            assert not (kw.get("want_dx") or kw.get("want_dw") or kw.get("want_db"))
            res.ticket = "t%d" % next(self._ids)
            self.tickets[res.ticket] = (x, w, targets, kw.get("bias"), kw.get("temperature"))
        return res

    def _compute(self, x, w, targets, *, bias=None, kind="cross_entropy", temperature=None,
                ignore_index=-100, want_entropy=False, dlogp=None, dentropy=None,
                advantages=None, old_logp=None, ref_logp=None, policy=None, teacher_x=None,
                teacher_w=None, teacher_bias=None, distill=None, want_dx=True, want_dw=True,
                want_db=None, grad_dtype=None, timeout=None, is_ratio=None):
        self.calls.append(dict(kind=kind, temperature=temperature, want_dx=want_dx,
                               want_dw=want_dw, want_db=want_db, grad_dtype=grad_dtype,
                               has_dlogp=dlogp is not None, has_ref=ref_logp is not None,
                               has_old=old_logp is not None, policy=policy, distill=distill,
                               has_targets=targets is not None, has_is_ratio=is_ratio is not None))
        t = 1.0 if temperature is None else float(temperature)
        x, w, b = (as64(a) for a in (x, w, bias))
        for a in (x, w, b):
            if a is not None:
                a.requires_grad_(True)
        tg = None if targets is None else torch.as_tensor(np.asarray(targets)).to(torch.int64)
        res = types.SimpleNamespace(loss=0.0, kl=0.0, clip_fraction=0.0, logp=None,
                                    entropy=None, dx=None, dw=None, db=None, ticket="")
        if kind == "logprob":
            logp, ent = logprob_entropy(x, w, b, tg, t, ignore_index)
            res.logp = logp.detach().numpy().astype(np.float32)
            res.entropy = ent.detach().numpy().astype(np.float32) if want_entropy else None
            f = 0.0
            if dlogp is not None:
                f = f + (as64(dlogp) * logp).sum()
            if dentropy is not None:
                f = f + (as64(dentropy) * ent).sum()
            objective = f if torch.is_tensor(f) else None
        elif kind == "policy":
            mask = (tg != ignore_index).to(DT)
            logp, _ = logprob_entropy(x, w, b, tg, t, ignore_index)
            loss, kl, clip = policy_loss(logp, mask, as64(advantages), as64(old_logp),
                                         as64(ref_logp), policy, int(policy["sequences"]),
                                         as64(is_ratio))
            res.loss, res.kl, res.clip_fraction = loss.item(), kl.item(), clip.item()
            objective = loss
        elif kind == "distill":
            lq = log_softmax(x, w, b, t)
            lp = log_softmax(as64(teacher_x), as64(teacher_w), as64(teacher_bias), t)
            keep = (torch.ones(x.shape[0], dtype=torch.bool) if tg is None
                    else tg != ignore_index)
            objective = jsd_loss(lq, lp, distill["jsd_beta"], keep)
            w_hard = distill.get("weight_hard_loss", 0.0)
            w_soft = distill.get("weight_soft_loss", 1.0)
            if (w_hard, w_soft) != (0.0, 1.0):
                objective = w_hard * hard_loss(x, w, b, tg, keep) + w_soft * objective
            res.loss = objective.item()
        else:
            raise ValueError("ReferenceClient computes the RL kinds only, not %r" % kind)
        if objective is not None and (want_dx or want_dw or want_db):
            objective.backward()
        res.dx = x.grad.numpy() if want_dx and x.grad is not None else None
        res.dw = w.grad.numpy() if want_dw and w.grad is not None else None
        res.db = b.grad.numpy() if want_db and b is not None and b.grad is not None else None
        return res
