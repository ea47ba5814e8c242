# SPDX-License-Identifier: Apache-2.0
"""The per-token KL estimate as a tensor of its own (verl's kl_penalty): for a KL penalty in
the rewards, or a metric, from log-probs the trainer already has (the logprob kind's output
and the reference model's). It needs no head and no server: the policy kind's KL term is the
same estimator inside the loss (PolicyOptions.kl_estimator)."""

import torch

from lossd import errors
from lossd._kinds import VERL_KL


def verl_kl_penalty(logp, ref_logp, kl_penalty="low_var_kl"):
    """Per-token KL(pi || ref) estimates, the shape of logp, by verl's name, d = logp - ref:
    "kl" / "k1" d; "abs" |d|; "mse" / "k2" d^2 / 2; "low_var_kl" / "k3" (verl's k3) e^x - x - 1
    at x = -d clamped to [-20, 20], the value clamped to [-10, 10]. A trailing "+" keeps the
    value with k2's gradient d (straight-through; "k2+" is k2). Differentiable in both
    arguments; raises InvalidArgumentError naming an unknown name or mismatched shapes."""
    name = str(kl_penalty)
    base = name[:-1] if name.endswith("+") else name
    if base not in VERL_KL:
        raise errors.InvalidArgumentError("kl_penalty must be one of %s (with an optional "
                                          "'+'), got %r" % (", ".join(VERL_KL), kl_penalty))
    logp, ref_logp = torch.as_tensor(logp), torch.as_tensor(ref_logp)
    if logp.shape != ref_logp.shape:
        raise errors.InvalidArgumentError("logp has shape %s and ref_logp %s: they must agree"
                                          % (tuple(logp.shape), tuple(ref_logp.shape)))
    d = logp - ref_logp
    kind = VERL_KL[base]
    if kind == "k1":
        value = d
    elif kind == "abs":
        value = d.abs()
    elif kind == "k2":
        value = 0.5 * d.square()
    else:  # low_var_kl
        x = torch.clamp(-d, min=-20.0, max=20.0)
        value = torch.clamp(x.exp() - x - 1.0, min=-10.0, max=10.0)
    if not name.endswith("+") or kind == "k2":
        return value
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + value.detach()
