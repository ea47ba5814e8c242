# SPDX-License-Identifier: Apache-2.0
"""Rollout correction for the policy kind (the trainer/rollout mismatch: a rollout engine's
log-probs are not the trainer's), computed where verl computes it: before the loss, from
log-probs the trainer has, log_ratio = old_logp - rollout_logp (the training policy's over
the rollout engine's). Two parts, by verl's names and semantics:

- importance weights (verl's rollout_is): per token exp(log_ratio), or per sequence
  exp(sum of its log-ratios) for every token of it; truncated at an upper bound (TIS), or zero
  outside [lower, upper] (IcePop, the threshold "lower_upper"); optionally divided by their
  mean over the batch. They go to the policy kind as is_ratio (a constant on each token's
  policy term, no gradient through it).
- rejection (verl's rollout_rs): tokens or whole sequences whose divergence from the rollout
  passes a bound are left out of the loss, their targets set to ignore_index.

No head and no server: both need log-probs only. Log-ratios are clamped to [-20, 20] before
exp, as verl does. Inputs are torch tensors of shape (B, S) (sequences by tokens)."""

import math

import torch

from lossd import errors

SAFETY_BOUND = 20.0
# verl's rollout_rs options: the divergence (k1 = -log_ratio, k2 = log_ratio^2 / 2,
# k3 = e^log_ratio - 1 - log_ratio) per token, or summed, averaged or maxed over a sequence.
REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                     "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
                     "seq_max_k3")


def _threshold(spec, name):
    """(upper, lower or None) from a number or verl's "lower_upper" string."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise errors.InvalidArgumentError("%s must be a number or a 'lower_upper' string, got %r"
                                          % (name, spec))
    text = str(spec).strip()
    try:
        if "_" in text:
            low, high = (float(t) for t in text.split("_", 1))
        else:
            low, high = None, float(text)
    except ValueError:
        raise errors.InvalidArgumentError("%s %r is not a number or 'lower_upper'"
                                          % (name, spec)) from None
    if not (high > 0 and math.isfinite(high)) or (low is not None and not 0 < low <= high):
        raise errors.InvalidArgumentError("%s %r: bounds must be finite, positive and lower <= "
                                          "upper" % (name, spec))
    return high, low


def _check(log_ratio, mask):
    log_ratio, mask = torch.as_tensor(log_ratio), torch.as_tensor(mask)
    if log_ratio.dim() != 2 or log_ratio.shape != mask.shape:
        raise errors.InvalidArgumentError(
            "log_ratio and mask must both be (sequences, tokens); got %s and %s"
            % (tuple(log_ratio.shape), tuple(mask.shape)))
    return log_ratio.detach(), mask


def _seq_mean(values, mask):
    m = mask.to(values.dtype)
    return (torch.where(mask.bool(), values, 0.0) * m).sum(-1) / (m.sum(-1) + 1e-8)


def rollout_is_weights(log_ratio, mask, rollout_is="token", rollout_is_threshold=2.0,
                       rollout_is_batch_normalize=False):
    """Importance weights for is_ratio, verl's compute_rollout_correction_weights: rollout_is
    "token" (exp(log_ratio) per token) or "sequence" (exp(sum of the sequence's log-ratios),
    every token of it); rollout_is_threshold a number (TIS: weights above it set to it) or
    "lower_upper" (IcePop: weights outside [lower, upper] set to 0);
    rollout_is_batch_normalize divides by their mean over the masked tokens (token) or the
    non-empty sequences (sequence). 0 where mask is 0. Detached; the dtype of log_ratio."""
    log_ratio, mask = _check(log_ratio, mask)
    if rollout_is not in ("token", "sequence"):
        raise errors.InvalidArgumentError("rollout_is must be 'token' or 'sequence', got %r"
                                          % (rollout_is,))
    upper, lower = _threshold(rollout_is_threshold, "rollout_is_threshold")
    m = mask.to(log_ratio.dtype)
    if rollout_is == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        total = (torch.where(mask.bool(), log_ratio, 0.0) * m).sum(-1, keepdim=True)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * m
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = (weights * m).sum() / (m.sum() + 1e-8)
        else:
            seq = _seq_mean(weights, mask)
            kept = (m.sum(-1) > 0).to(weights.dtype)
            mean = (seq * kept).sum() / kept.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
    return weights


def rollout_rejection_mask(log_ratio, mask, rollout_rs="token_k1", rollout_rs_threshold=None):
    """The mask with the rejected tokens set to 0, verl's compute_rollout_rejection_mask:
    rollout_rs one or more of REJECTION_OPTIONS, comma-separated (a token is kept only where
    every option keeps it); rollout_rs_threshold one bound for all or one per option. k1
    options keep lower <= k1 <= upper in log space of "lower_upper" ratio bounds (a single
    number u means 1/u_u); the others keep the statistic <= the bound. A sequence option
    rejects its whole sequence. Raises InvalidArgumentError naming what is wrong."""
    log_ratio, mask = _check(log_ratio, mask)
    options = [o.strip() for o in str(rollout_rs).split(",") if o.strip()]
    options = list(dict.fromkeys(options))
    bad = [o for o in options if o not in REJECTION_OPTIONS]
    if not options or bad:
        raise errors.InvalidArgumentError("rollout_rs must be one or more of %s, got %r"
                                          % (", ".join(REJECTION_OPTIONS), rollout_rs))
    if rollout_rs_threshold is None:
        raise errors.InvalidArgumentError("rollout_rs_threshold is required")
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise errors.InvalidArgumentError(
            "rollout_rs_threshold has %d entries for %d options: give one, or one each"
            % (len(specs), len(options)))
    specs = specs * len(options) if len(specs) == 1 else specs
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    keep = torch.ones_like(log_ratio)
    for option, spec in zip(options, specs):
        estimator = stats[option[-2:]]
        if option.endswith("k1"):
            if "_" not in spec:
                spec = "%r_%s" % (1.0 / float(spec), spec)
            upper, lower = _threshold(spec, "rollout_rs_threshold for " + option)
            lo, hi = math.log(lower), math.log(upper)
        else:
            upper, lower = _threshold(spec, "rollout_rs_threshold for " + option)
            if lower is not None:
                raise errors.InvalidArgumentError(
                    "rollout_rs_threshold for %s takes one upper bound, got %r" % (option, spec))
            lo, hi = None, upper
        if option.startswith("token"):
            stat = estimator
        elif option.startswith("seq_sum"):
            stat = (torch.where(mask.bool(), estimator, 0.0) * mask.to(estimator.dtype)).sum(-1)
        elif option.startswith("seq_mean"):
            stat = _seq_mean(estimator, mask)
        else:  # seq_max over the masked tokens (0 for an empty sequence)
            stat = estimator.masked_fill(~mask.bool(), float("-inf")).max(-1).values
            stat = torch.where(stat == float("-inf"), torch.zeros_like(stat), stat)
        ok = stat <= hi if lo is None else (stat >= lo) & (stat <= hi)
        if not option.startswith("token"):
            ok = ok.unsqueeze(-1).expand_as(log_ratio)
        keep = keep * ok.to(keep.dtype)
    return (mask * keep).to(mask.dtype)
