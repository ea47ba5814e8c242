# SPDX-License-Identifier: Apache-2.0
"""PyTorch: RL and distillation losses over the LM head on a lossd server (docs/rl_losses.md).

- Per-token log-probabilities and entropy from hidden states and the head, with the calling
  conventions of verl's helpers: `fused_linear_for_ppo` / `LossdFusedLinearForPPO` (verl's
  FusedLinearForPPO: (log_probs, entropy)), `linear_cross_entropy` (verl's fused kernel's
  entry), `logprobs_from_hidden` and `entropy_from_hidden` (logprobs_from_logits and
  entropy_from_logits, with the logits never formed).
- `LossdFusedLinearGRPOLoss`: LigerFusedLinearGRPOLoss's constructor and forward arguments;
  forward returns (loss, metrics).
- `LossdFusedLinearJSD`: LigerFusedLinearJSD's constructor and forward arguments;
  `LossdFusedLinearJSDLoss` and `fused_linear_jsd_loss`: LigerFusedLinearJSDLoss's and its
  function's, with the hard-label term (lossd._rl_distill).
- `LossdTopkDistillLoss` and `topk_distill_loss`: distillation from the teacher's top-k ids
  and log-probs, no teacher head (lossd._rl_distill_topk).
- `verl_kl_penalty`: the per-token KL estimate by verl's names, from log-probs the trainer
  has (lossd._rl_kl; no server).
- `rollout_is_weights` and `rollout_rejection_mask`: the rollout correction (truncated or
  IcePop importance weights per token or sequence, for is_ratio; rejection of tokens or
  sequences by their divergence from the rollout), by verl's names (lossd._rl_rollout; no
  server).

Autograd through them gives dX, dW and db, computed by the server. The log-prob helpers run
forward only (the upstream gradient of a log-prob is not known then) and backward sends the
upstream gradients, in two phases by default (keep_ms, 60 s: the server keeps X under a
ticket, and backward sends only dlogp and dentropy; lossd._rl_logprob) or with keep_ms=0 in
one (backward sends X again; W goes once when weight caching is on). The GRPO and JSD
losses are scalars: one call returns the loss and the gradients, and backward scales them.
Keyword-only connection settings as lossd.nn's modules: client, server, cache_weights,
timeout, or a shared `runtime` (lossd.nn.LossdRuntime). A runtime with a server-side
`accumulator` adds dW and db there instead of returning them (dX still comes back): the
scalar losses then compute the loss alone in forward and the gradients in backward, with
grad_scale = upstream gradient x the runtime's grad_scale, as lossd.nn's deferred mode; call
`apply_accumulated_gradients` before the optimizer step. Mixed precision as Liger's: each
call computes in the hidden states' dtype, or under torch.autocast in its dtype (W, the
bias, the teacher's and the reference head cast to it), and every gradient comes back in its
own tensor's dtype. A loss that overflows fp32 comes back inf (servers listing
"nonfinite_loss"; refused into an accumulator).
"""

import warnings

import torch

from lossd import errors
from lossd._rl_common import (_fp32, _grad, _grad_dtype, _grad_kw, _int64, _nonfinite_kw, _once,
                              _runtime)
from lossd._rl_logprob import DEFAULT_KEEP_MS, LossdLogprobFunction, logprob_entropy
from lossd._two_phase import check_keep_ms
from lossd.nn import LossdRuntime, compute_dtype


class _OnServer(torch.nn.Module):
    """What the modules share: their runtime (connection, weight cache, accumulator)."""

    def _setup(self, runtime, client, server, cache_weights, timeout, accumulator, grad_scale):
        self.runtime = runtime or LossdRuntime(client, server, cache_weights=cache_weights,
                                               timeout=timeout, accumulator=accumulator,
                                               grad_scale=grad_scale)
        # A second weight cache on the same client, for the teacher's or reference head.
        self.other_runtime = LossdRuntime(self.runtime.client,
                                          cache_weights=self.runtime.cache_weights,
                                          timeout=self.runtime.timeout)

    def apply_accumulated_gradients(self, weight, bias=None, reset=True):
        """With an accumulator: adds its fp32 dW (and db) into weight.grad (bias.grad)."""
        return self.runtime.apply_accumulated_gradients(weight, bias, reset=reset)

    def fetch_gradients(self, reset=True):
        return self.runtime.fetch_gradients(reset=reset)

    def release(self):
        """Drops the weights this module uploaded."""
        self.runtime.close()
        self.other_runtime.close()


def fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature=1.0, *,
                         bias=None, runtime=None, server="localhost:50051",
                         keep_ms=DEFAULT_KEEP_MS):
    """verl's FusedLinearForPPO: (log_probs fp32, entropy in the hidden states' dtype), each
    of input_ids' shape, of softmax((hidden_states @ vocab_weights.T + bias) / temperature).
    keep_ms: how long the server keeps X for the backward (two-phase; 0 = one-phase: backward
    sends X again). Only where a backward can follow (grad enabled, an input requiring it)."""
    logp, entropy = logprob_entropy(hidden_states, vocab_weights, input_ids, temperature, bias,
                                    runtime, server, keep_ms)
    return logp, entropy.to(hidden_states.dtype)


class LossdFusedLinearForPPO(_OnServer):
    """verl's FusedLinearForPPO module on the server. chunk_size and impl_backend are taken
    for compatibility; the server chooses its own chunking. keep_ms: fused_linear_for_ppo's."""

    def __init__(self, chunk_size=512, impl_backend="torch", *, client=None,
                 server="localhost:50051", cache_weights=True, timeout=None, accumulator=None,
                 grad_scale=1.0, runtime=None, keep_ms=DEFAULT_KEEP_MS):
        super().__init__()
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend
        self.keep_ms = check_keep_ms(keep_ms)
        self._setup(runtime, client, server, cache_weights, timeout, accumulator, grad_scale)

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        return fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature,
                                    runtime=self.runtime, keep_ms=self.keep_ms)


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
                         dist_process_group=None, *, bias=None, runtime=None,
                         server="localhost:50051", keep_ms=DEFAULT_KEEP_MS):
    """verl's fused linear_cross_entropy entry: (logprobs, entropy) per token (reduction
    "none"), or their sums / means ("sum", "mean"). A vocabulary split over a process group
    (dist_process_group) is not supported: give the whole head. keep_ms: as
    fused_linear_for_ppo's."""
    if dist_process_group is not None:
        raise errors.InvalidArgumentError(
            "dist_process_group: a vocabulary-parallel head is not supported; give the whole "
            "(V, H) weight", method="rl")
    if reduction not in ("none", "sum", "mean"):
        raise errors.InvalidArgumentError(
            "reduction must be 'none', 'sum' or 'mean', got %r" % (reduction,), method="rl")
    logp, entropy = logprob_entropy(hidden, weight, labels, temperature, bias, runtime, server,
                                    keep_ms)
    if reduction == "sum":
        return logp.sum(), entropy.sum()
    if reduction == "mean":
        return logp.mean(), entropy.mean()
    return logp, entropy


def logprobs_from_hidden(hidden_states, weight, labels, temperature=1.0, *, bias=None,
                         runtime=None, server="localhost:50051", keep_ms=DEFAULT_KEEP_MS):
    """verl's logprobs_from_logits(logits, labels) with logits = (hidden_states @ weight.T +
    bias) / temperature never formed: log p(label), fp32, of labels' shape. keep_ms: as
    fused_linear_for_ppo's."""
    return logprob_entropy(hidden_states, weight, labels, temperature, bias, runtime, server,
                           keep_ms)[0]


def entropy_from_hidden(hidden_states, weight, temperature=1.0, *, bias=None, runtime=None,
                        server="localhost:50051", keep_ms=DEFAULT_KEEP_MS):
    """verl's entropy_from_logits(logits) with the logits never formed: the softmax's entropy
    per row, fp32, of hidden_states.shape[:-1]. keep_ms: as fused_linear_for_ppo's."""
    labels = torch.zeros(hidden_states.shape[:-1], dtype=torch.int64,
                         device=hidden_states.device)  # any valid id: only the entropy is used
    return logprob_entropy(hidden_states, weight, labels, temperature, bias, runtime, server,
                           keep_ms)[1]


class _ScalarLossFunction(torch.autograd.Function):
    """apply(x, weight, bias, call, runtime, *metric names) -> (loss, metrics...):
    `call(want_dx, want_dw, want_db, **grad_kw)` runs the Compute. Without an accumulator
    the loss's gradients come with it and backward scales them by the upstream gradient;
    with one, forward computes the loss alone and backward sends the call again with the
    upstream gradient as grad_scale (dW and db go into the accumulator)."""

    @staticmethod
    def forward(ctx, x, weight, bias, call, runtime, *metric_names):
        ctx.needs = (x.requires_grad, weight.requires_grad,
                     bias is not None and bias.requires_grad)
        ctx.others = 2 + len(metric_names)  # call, runtime and the names take no gradient
        ctx.deferred = runtime.accumulator is not None and any(ctx.needs)
        ctx.call, ctx.runtime, ctx.like = call, runtime, (x, weight, bias)
        r = call(False, False, False) if ctx.deferred else call(*ctx.needs)
        if not ctx.deferred:
            ctx.grads = tuple(_grad(v, t) if need else None
                              for v, t, need in zip((r.dx, r.dw, r.db), ctx.like, ctx.needs))
        dev = x.device
        loss = torch.tensor(r.loss, dtype=torch.float32, device=dev)
        metrics = [torch.tensor(getattr(r, m), dtype=torch.float32, device=dev)
                   for m in metric_names]
        ctx.mark_non_differentiable(*metrics)
        return (loss, *metrics)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        _once()
        rest = (None,) * ctx.others
        if grad_loss is None:
            return (None, None, None) + rest
        if ctx.deferred:
            need_dx, need_dw, need_db = ctx.needs
            r = ctx.call(need_dx, need_dw, need_db,
                         **_grad_kw(ctx.runtime, float(grad_loss.detach())))
            return (_grad(r.dx, ctx.like[0]) if need_dx else None, None, None) + rest
        grads = ctx.grads  # kept: a retained graph's second backward gives them again
        return (*(None if g is None else g * grad_loss.to(g.dtype) for g in grads), *rest)


_GRPO_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
_CLIPPED_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo")  # those delta applies to


def _rows_of_ratio(rho, bsz, seq, vespo):
    """Liger's vllm_is_ratio, (B, S) or (B, 1), as one value per row. A (B, 1) one repeats
    over the sequence's tokens, each of which it multiplies; with vespo, whose server sums
    each row's clamped log ratio into the sequence's weight, it goes on the sequence's first
    row and 1 (log 0) on the others, so it counts once, as Liger's (B, 1) does."""
    if rho.shape[1] == seq or not vespo:
        return rho.expand(bsz, seq).reshape(-1)
    rows = torch.ones(bsz, seq, dtype=rho.dtype, device=rho.device)
    rows[:, 0] = rho[:, 0]
    return rows.reshape(-1)


def _check_grpo_arguments(loss_type, importance_sampling_level, sapo_temperature_pos,
                          sapo_temperature_neg, epsilon_high, delta, max_completion_length,
                          temperature):
    """LigerFusedLinearGRPOLoss's constructor checks (its messages, as ValueErrors), and
    what lossd does not compute, refused by the argument's name."""
    if loss_type not in _GRPO_LOSS_TYPES:
        raise errors.InvalidArgumentError("Unknown loss type: %s (lossd computes %s)" % (
            loss_type, ", ".join(_GRPO_LOSS_TYPES)), method="rl")
    if importance_sampling_level not in ("token", "sequence"):
        raise errors.InvalidArgumentError(  # Liger's message
            "Unknown importance sampling level: %s. Possible values are 'token' and "
            "'sequence'." % (importance_sampling_level,), method="rl")
    if importance_sampling_level == "sequence" and loss_type not in _CLIPPED_LOSS_TYPES:
        raise errors.InvalidArgumentError(  # Liger raises it at its forward
            "Sequence-level importance sampling is not supported for loss_type='%s'. Use "
            "importance_sampling_level='token' instead." % (loss_type,), method="rl")
    for name, value in (("sapo_temperature_pos", sapo_temperature_pos),
                        ("sapo_temperature_neg", sapo_temperature_neg)):
        if not value > 0:
            raise errors.InvalidArgumentError("%s must be positive, got %s" % (name, value),
                                              method="rl")
    if delta is not None:
        if not delta > 0:
            raise errors.InvalidArgumentError("delta must be positive, got %s" % (delta,),
                                              method="rl")
        if not delta > 1 + epsilon_high:
            raise errors.InvalidArgumentError(
                "delta must be > 1 + epsilon_high = %s (it caps the ratio above the clip "
                "range), got %s" % (1 + epsilon_high, delta), method="rl")
        if loss_type not in _CLIPPED_LOSS_TYPES:
            raise errors.InvalidArgumentError(
                "delta applies to the clipped loss types (%s); loss_type %r has no clipped "
                "surrogate" % (", ".join(_CLIPPED_LOSS_TYPES), loss_type), method="rl")
    if loss_type == "dr_grpo" and max_completion_length is None:
        # Liger asserts this (at its forward); lossd checks it at construction.
        raise errors.ArgumentAssertionError(
            "max_completion_length must be provided for loss_type 'dr_grpo'", method="rl")
    if temperature == 0:
        raise errors.InvalidArgumentError("temperature cannot be 0", method="rl")


class LossdFusedLinearGRPOLoss(_OnServer):
    """LigerFusedLinearGRPOLoss (Liger-Kernel 0.8.5) on the server: the same constructor and
    forward arguments; forward returns (loss, metrics), metrics = (mean KL, clip fraction)
    when beta != 0, else (clip fraction,). Loss types dapo (default), grpo, bnpo, dr_grpo,
    cispo, sapo, luspo and vespo (servers listing "policy_loss_type_vespo", with the vespo_*
    gamma parameters) with sapo_temperature_pos / _neg, delta and use_bias_correction_kl,
    token- or sequence-level importance sampling (GSPO, the clipped types; servers listing
    "policy_sequence_importance_sampling"); `compiled` and `chunk_size` are taken and unused.
    Refused (InvalidArgumentError, a ValueError): sequence level with cispo, sapo or vespo (as
    Liger), and delta with them (which Liger ignores). vllm_is_ratio ((B, S) or (B, 1))
    multiplies each token's policy term (servers listing "policy_is_ratio"); with vespo it
    enters the sequence's weight instead, as Liger's: a (B, S) one summed over every token,
    masked or not, a (B, 1) one once per sequence. luspo counts masked tokens out (Liger's token-level luspo counts them in).
    advantages may be per sequence (B) as Liger's or per token (B, S)."""

    def __init__(self, beta=0.04, compiled=True, use_ref_model=True, chunk_size=1,
                 epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo", max_completion_length=None,
                 importance_sampling_level="token", sapo_temperature_pos=1.0,
                 sapo_temperature_neg=1.05, temperature=1.0, delta=None,
                 use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                 vespo_k_neg=3.0, vespo_lambda_neg=2.0, *, client=None,
                 server="localhost:50051", cache_weights=True, timeout=None, accumulator=None,
                 grad_scale=1.0, runtime=None):
        super().__init__()
        _check_grpo_arguments(loss_type, importance_sampling_level, sapo_temperature_pos,
                              sapo_temperature_neg, epsilon_high, delta, max_completion_length,
                              temperature)
        self.beta, self.compiled, self.use_ref_model = beta, compiled, use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high
        self.loss_type, self.max_completion_length = loss_type, max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.delta, self.use_bias_correction_kl = delta, use_bias_correction_kl
        self.vespo_k_pos, self.vespo_lambda_pos = vespo_k_pos, vespo_lambda_pos
        self.vespo_k_neg, self.vespo_lambda_neg = vespo_k_neg, vespo_lambda_neg
        self.temperature = temperature
        self._setup(runtime, client, server, cache_weights, timeout, accumulator, grad_scale)

    def _dapo_normalizer(self, mask, num_items_in_batch):
        """Liger's per-process dapo normaliser: num_items_in_batch / world size, else the
        mask count summed over ranks / world size; at least 1 (dapo, cispo and vespo). 0 for
        the other types."""
        if self.loss_type not in ("dapo", "cispo", "vespo"):
            return 0.0
        dist = torch.distributed
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if num_items_in_batch is not None:
            n = float(num_items_in_batch)
        elif world > 1:
            total = mask.detach().to(torch.float32).sum()
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            n = float(total)
        else:
            return 0.0  # the server's own mask count, clamped to 1 as Liger does
        return max(1.0, n / world)

    def _ref_logps(self, ref_per_token_logps, ref_input, ref_weight, ref_bias, ids, bsz):
        """The reference log-probs to send, or None (no KL term)."""
        if self.beta == 0 or not self.use_ref_model:
            return None
        if ref_per_token_logps is not None:
            if ref_input is not None:  # Liger warns the same: the given log-probs win
                warnings.warn("Both ref_per_token_logps and ref_input are provided. Using "
                              "ref_per_token_logps.")
            return _fp32(ref_per_token_logps)
        if ref_input is None or ref_weight is None:
            raise errors.ArgumentAssertionError(  # Liger asserts this
                "use_ref_model with beta != 0 needs ref_per_token_logps, or ref_input and "
                "ref_weight", method="rl")
        rx = ref_input.reshape(-1, ref_input.shape[-1])
        cdt = compute_dtype(rx)
        r = self.other_runtime.compute(rx.to(cdt), ref_weight, ids, ref_bias, kind="logprob",
                                       temperature=float(self.temperature), want_dx=False,
                                       want_dw=False, want_db=False, weight_dtype=cdt)
        return torch.from_numpy(r.logp)

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages,
                bias=None, ref_per_token_logps=None, old_per_token_logps=None, ref_input=None,
                ref_weight=None, ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None):
        if selected_token_ids.dim() != 2 or attention_mask.shape != selected_token_ids.shape:
            raise errors.InvalidArgumentError(
                "selected_token_ids and attention_mask must be (B, S) alike, got %s and %s" % (
                    tuple(selected_token_ids.shape), tuple(attention_mask.shape)), method="rl")
        bsz, seq = selected_token_ids.shape
        x2 = _input.reshape(-1, _input.shape[-1])
        if x2.shape[0] != bsz * seq:
            raise errors.InvalidArgumentError(
                "_input has %d rows; selected_token_ids (%d, %d) needs %d" % (
                    x2.shape[0], bsz, seq, bsz * seq), method="rl")
        adv = advantages.detach().to(torch.float32)
        if tuple(adv.shape) == (bsz,):
            adv = adv.unsqueeze(1).expand(bsz, seq)
        elif tuple(adv.shape) != (bsz, seq):
            raise errors.InvalidArgumentError(
                "advantages must be (B) or (B, S) = (%d, %d), got %s" % (
                    bsz, seq, tuple(adv.shape)), method="rl")
        ids = _int64(selected_token_ids, "selected_token_ids")
        ignore = -100
        targets = torch.where(attention_mask.reshape(-1).bool(), ids, torch.full_like(ids, ignore))
        policy = dict(loss_type=self.loss_type, epsilon_low=self.epsilon_low,
                      epsilon_high=self.epsilon_high, beta=self.beta, sequences=bsz,
                      max_completion_length=int(self.max_completion_length or 0),
                      dapo_normalizer=self._dapo_normalizer(attention_mask, num_items_in_batch),
                      sapo_temperature_pos=self.sapo_temperature_pos,
                      sapo_temperature_neg=self.sapo_temperature_neg, delta=self.delta,
                      use_bias_correction_kl=bool(self.use_bias_correction_kl),
                      importance_sampling=self.importance_sampling_level)
        if self.loss_type == "vespo":
            policy.update(vespo_k_pos=self.vespo_k_pos, vespo_lambda_pos=self.vespo_lambda_pos,
                          vespo_k_neg=self.vespo_k_neg, vespo_lambda_neg=self.vespo_lambda_neg)
        runtime = _runtime(self.runtime, None)
        rho = None
        if vllm_is_ratio is not None:  # Liger's (B, S) or (B, 1), repeated over the tokens
            rho = vllm_is_ratio.detach().to(torch.float32)
            rho = rho.unsqueeze(1) if rho.dim() == 1 else rho  # Liger's (B,) is its (B, 1)
            if rho.dim() != 2 or rho.shape[0] != bsz or rho.shape[1] not in (1, seq):
                raise errors.InvalidArgumentError(
                    "vllm_is_ratio must be (B, S) = (%d, %d) or (B, 1), got %s" % (
                        bsz, seq, tuple(rho.shape)), method="rl")
            rho = _rows_of_ratio(rho, bsz, seq, self.loss_type == "vespo")
            runtime.client.require_feature("policy_is_ratio", timeout=runtime.timeout)
        ref = self._ref_logps(ref_per_token_logps, ref_input, ref_weight, ref_bias, ids, bsz)
        if self.importance_sampling_level == "sequence":
            runtime.client.require_feature("policy_sequence_importance_sampling",
                                           timeout=runtime.timeout)
        # Liger's chunked GRPO casts W to the hidden states' dtype (under autocast, the
        # autocast dtype): so does the call, and dX, dW, db come back in their own dtypes.
        cdt = compute_dtype(x2)
        xc = x2.detach().to(cdt)

        def call(want_dx, want_dw, want_db, **grad_kw):
            gdt = _grad_dtype(cdt, x2 if want_dx else None, lin_weight if want_dw else None,
                              bias if want_db else None)
            return runtime.compute(xc, lin_weight, targets, bias, kind="policy",
                                   temperature=float(self.temperature), ignore_index=ignore,
                                   advantages=adv.reshape(-1), old_logp=_fp32(old_per_token_logps),
                                   ref_logp=ref, policy=policy, is_ratio=rho, want_dx=want_dx,
                                   want_dw=want_dw, want_db=want_db, grad_dtype=gdt,
                                   weight_dtype=cdt, **_nonfinite_kw(runtime, grad_kw), **grad_kw)

        metric_names = ("kl", "clip_fraction") if self.beta != 0 else ("clip_fraction",)
        loss, *metrics = _ScalarLossFunction.apply(x2, lin_weight, bias, call, runtime,
                                                   *metric_names)
        return loss, tuple(metrics)


class LossdFusedLinearJSD(_OnServer):
    """LigerFusedLinearJSD (Liger-Kernel 0.8.5) on the server: the same constructor and forward
    arguments (plus optional student_bias and teacher_bias, which Liger's lacks). The teacher's
    head is cached on the server like the student's when cache_weights is on (uploaded once
    while unchanged). accum_dtype: None or torch.float32 (gradients travel in fp32)."""

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype=None, *,
                 client=None, server="localhost:50051", cache_weights=True, timeout=None,
                 accumulator=None, grad_scale=1.0, runtime=None):
        super().__init__()
        if temperature == 0:  # Liger asserts this
            raise errors.ArgumentAssertionError("temperature cannot be 0", method="rl")
        if accum_dtype not in (None, torch.float32):
            raise errors.InvalidArgumentError(
                "accum_dtype must be None or torch.float32, got %s" % (accum_dtype,),
                method="rl")
        self.jsd_beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature
        self.accum_dtype = accum_dtype
        self._setup(runtime, client, server, cache_weights, timeout, accumulator, grad_scale)

    def _distill_options(self, runtime):
        """The request's DistillOptions (LossdFusedLinearJSDLoss adds its weights)."""
        return {"jsd_beta": float(self.jsd_beta)}

    def _teacher(self, teacher_weight, teacher_bias, dtype, refresh=False):
        """teacher_w and teacher_bias for compute(), in the compute dtype: its handle when
        caching, else inline."""
        t = self.other_runtime
        if refresh:
            t.drop_weights()
        ref = t.weight_ref(teacher_weight, teacher_bias, dtype)
        if ref is None:
            return tuple(None if v is None else v.detach().to(dtype)
                         for v in (teacher_weight, teacher_bias))
        return ref, None

    def forward(self, student_input, student_weight, teacher_input, teacher_weight,
                shift_labels=None, student_bias=None, teacher_bias=None):
        x2 = student_input.reshape(-1, student_input.shape[-1])
        # Under autocast (which LigerFusedLinearJSD supports) its dtype, else the student's
        # hidden states': both heads and the teacher's hidden states travel in it (the wire
        # takes one dtype); dX, dW and db come back in their own dtypes.
        cdt = compute_dtype(x2)
        xc = x2.detach().to(cdt)
        tx = teacher_input.reshape(-1, teacher_input.shape[-1]).detach().to(cdt)
        labels = None if shift_labels is None else _int64(shift_labels, "shift_labels")
        runtime = _runtime(self.runtime, None)
        fp32 = self.accum_dtype == torch.float32
        opts = dict(kind="distill", temperature=float(self.temperature),
                    ignore_index=int(self.ignore_index), distill=self._distill_options(runtime),
                    teacher_x=tx, weight_dtype=cdt)

        def call(want_dx, want_dw, want_db, **grad_kw):
            gdt = "fp32" if fp32 else _grad_dtype(
                cdt, x2 if want_dx else None, student_weight if want_dw else None,
                student_bias if want_db else None)
            kw = dict(opts, grad_dtype=gdt, **_nonfinite_kw(runtime, grad_kw), **grad_kw)
            tw, tb = self._teacher(teacher_weight, teacher_bias, cdt)
            try:
                return runtime.compute(xc, student_weight, labels, student_bias, teacher_w=tw,
                                       teacher_bias=tb, want_dx=want_dx, want_dw=want_dw,
                                       want_db=want_db, **kw)
            except errors.NotFoundError:
                if torch.is_tensor(tw):  # sent inline: nothing was dropped
                    raise
                # The teacher's handle was dropped (evicted, a restart): upload it once more.
                tw, tb = self._teacher(teacher_weight, teacher_bias, cdt, refresh=True)
                return runtime.compute(xc, student_weight, labels, student_bias, teacher_w=tw,
                                       teacher_bias=tb, want_dx=want_dx, want_dw=want_dw,
                                       want_db=want_db, **kw)

        loss, = _ScalarLossFunction.apply(x2, student_weight, student_bias, call, runtime)
        return loss


from lossd._rl_distill import LossdFusedLinearJSDLoss, fused_linear_jsd_loss  # noqa: E402
from lossd._rl_distill_topk import LossdTopkDistillLoss, topk_distill_loss  # noqa: E402
from lossd._rl_kl import verl_kl_penalty  # noqa: E402
from lossd._rl_rollout import rollout_is_weights, rollout_rejection_mask  # noqa: E402

__all__ = ["fused_linear_for_ppo", "LossdFusedLinearForPPO", "linear_cross_entropy",
           "logprobs_from_hidden", "entropy_from_hidden", "LossdLogprobFunction",
           "LossdFusedLinearGRPOLoss", "LossdFusedLinearJSD", "LossdFusedLinearJSDLoss",
           "fused_linear_jsd_loss", "LossdTopkDistillLoss", "topk_distill_loss",
           "verl_kl_penalty", "rollout_is_weights", "rollout_rejection_mask"]
