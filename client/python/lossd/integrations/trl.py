# SPDX-License-Identifier: Apache-2.0
"""lossd inside TRL: apply_lossd(trainer, server) makes an SFTTrainer's or GRPOTrainer's per-token
log-probabilities and entropies come from lossd instead of TRL's chunked log-softmax.

TRL (1.x) gives the trainer's model (and GRPO's reference model) a fused LM head in the
trainer's __init__ (trl.trainer.utils.add_fused_lm_head): a call with `fused_lm_head=True` runs
the backbone and returns a FusedCausalLMOutput of per-token log_probs, entropy (and, for
SFTTrainer's token accuracy, is_top1) without forming the logits. That call is the seam: it is
replaced, on these model instances only, by the same computation through lossd's two-phase
log-prob (lossd.rl's logprob helpers): forward sends the hidden states of the positions whose
label is not -100, the head (by handle while unchanged) and the labels, and gets log p and the
entropy at the trainer's temperature; backward sends dlogp (and dentropy where an entropy
bonus uses it) under the ticket forward took, so X crosses once, and gets dX and dW. TRL's
own loss (GRPO's clipped objective, SFT's negative log-likelihood) runs on top, unchanged.

Calls without fused_lm_head (generation, evaluation of logits) run TRL's forward unchanged.
Imports torch, transformers and trl.
"""

import collections
import functools

import torch

from lossd import errors
from lossd._rl_logprob import DEFAULT_KEEP_MS, logprob_entropy
from lossd.nn import LossdRuntime, lossd_fused_linear_cross_entropy
from lossd.integrations.transformers import (
    _connect, _inline_runtime, _named, _refuse_sharded, _under_fsdp, _zero3)

# The trainers whose fused-head calls are covered, by class name, and whether their metrics
# read is_top1 (SFTTrainer's mean_token_accuracy).
TRAINERS = {"SFTTrainer": True, "GRPOTrainer": False}


def _trainer_kind(trainer):
    name = next((c.__name__ for c in type(trainer).__mro__ if c.__name__ in TRAINERS), None)
    if name is None:
        raise errors.InvalidArgumentError(
            "lossd.integrations.trl.apply_lossd supports %s; got a %s" % (
                ", ".join(sorted(TRAINERS)), type(trainer).__name__), method="apply_lossd")
    return name


def _has_fused_head(forward):
    """Whether `forward` is TRL's fused-head forward, or wraps it: accelerate's
    prepare_model under mixed precision wraps GRPO's reference model's forward in its
    autocast and ConvertOutputsToFp32 (each keeps the inner one as __wrapped__ or
    model_forward). TRL's own signature is the class forward's (functools.wraps), so the code
    object's arguments tell."""
    f = forward
    for _ in range(8):
        func = getattr(f, "__func__", f)
        code = getattr(func, "__code__", None)
        if code is not None and "fused_lm_head" in code.co_varnames[
                :code.co_argcount + code.co_kwonlyargcount]:
            return True
        f = (getattr(func, "__wrapped__", None) or getattr(func, "model_forward", None)
             or getattr(f, "__wrapped__", None))
        if f is None:
            return False
    return False


def _check_model(model, what):
    """The model must carry TRL's fused head (its forward takes fused_lm_head) and nothing
    lossd's log-prob does not compute: a final softcap or a logit scale."""
    if getattr(model, "_lossd_trl_patch", None) is not None:
        raise errors.FailedPreconditionError(
            "apply_lossd was already applied to this trainer's %s; call remove() on the "
            "patch it returned first" % what, method="apply_lossd")
    if not _has_fused_head(model.forward):
        raise errors.FailedPreconditionError(
            "the trainer's %s has no fused LM head (its forward takes no fused_lm_head): "
            "TRL >= 1.0's trainers add it in __init__; call apply_lossd(trainer, ...) after "
            "constructing the trainer, with a PEFT model unwrapped" % what,
            method="apply_lossd")
    text = model.config.get_text_config()
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier",
                 "lm_head_multiplier", "logits_scaling"):
        value = getattr(text, attr, None)
        if value not in (None, 1, 1.0):
            raise errors.InvalidArgumentError(
                "the trainer's %s has config.%s=%r: lossd's log-prob takes the head's logits "
                "as they are (no softcap or logit scale); not covered" % (what, attr, value),
                method="apply_lossd")
    if getattr(text, "output_router_logits", False):
        raise errors.InvalidArgumentError(
            "the trainer's %s asks for router logits (a mixture of experts' load-balancing "
            "loss): not covered" % what, method="apply_lossd")


class TrlPatch:
    """What apply_lossd did to one trainer: `models` patched (the policy, and GRPO's
    reference model when it has one), `runtime` (their lossd.nn.LossdRuntime), `calls`
    (fused-head calls through lossd, by model), `remove()`."""

    def __init__(self, trainer, client, address, runtime, keep_ms):
        self.trainer = trainer
        self.client = client
        self.address = address
        self.runtime = runtime
        self.keep_ms = keep_ms
        self.models = []
        self.calls = collections.Counter()
        self._saved = []
        self._inline = None  # the runtime sending W inline (a ZeRO-3 head), made on first use

    def remove(self):
        """Puts TRL's fused forwards back and frees the cached head."""
        for model, forward in self._saved:
            model.forward = forward
            model._lossd_trl_patch = None
        self._saved = []
        for rt in (self.runtime, self._inline):
            if rt is not None:
                rt.close()


def _per_token(patch, x, lm_head, labels, temperature, top1, fp32_head):
    """(log p, entropy, is_top1 or None) of the rows x (N, H) against labels (N)."""
    w, b = lm_head.weight, lm_head.bias
    _refuse_sharded(w, "TRL's fused LM head")
    runtime = _inline_runtime(patch) if _zero3(w, "TRL's fused LM head") else patch.runtime
    if _under_fsdp(patch.model_of_call, w):
        # As transformers.LossdPatch.loss: FSDP frees the gathered head's storage, which
        # the client's numpy view would have pinned. The copy is new each call: inline.
        w, b = w.clone(), None if b is None else b.clone()
        runtime = _inline_runtime(patch)
    if fp32_head:  # TRL's cast_lm_head_to_fp32: the projection in fp32, outside autocast
        x = x.float()
    with torch.autocast(x.device.type, enabled=not fp32_head and
                        torch.is_autocast_enabled(x.device.type)):
        logp, entropy = logprob_entropy(x, w, labels, temperature, b, runtime, None,
                                        patch.keep_ms)
        is_top1 = None
        if top1:
            # The argmax does not depend on the temperature. W itself (not a detached alias,
            # a new tensor the weight cache would not know) so its cached handle serves.
            with torch.no_grad():
                out = lossd_fused_linear_cross_entropy(
                    x.detach(), w, labels, b, reduction="none", return_predicted_tokens=True,
                    runtime=runtime)
            is_top1 = out.predicted_tokens.to(labels.device) == labels
    return logp, entropy, is_top1


@torch.compiler.disable
def _outside_compile(fn, *args):
    # gRPC calls: under torch.compile they run eagerly (one graph break).
    return fn(*args)


def _fused_forward(patch, model, trl_forward, name, temperature, top1, fp32_head):
    """TRL's fused-head forward (add_fused_lm_head's) with the per-token values from lossd."""
    from trl.trainer.utils import FusedCausalLMOutput

    @functools.wraps(trl_forward)
    def forward(*args, fused_lm_head=False, labels=None, shift_labels=None,
                num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, fused_lm_head=False, labels=labels,
                               shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                               **kwargs)
        kwargs["use_cache"] = False
        hidden = model.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        lm_head = model.get_output_embeddings()
        hidden, labels = hidden.to(lm_head.weight.device), labels.to(lm_head.weight.device)
        mask = labels != -100
        patch.calls[name] += 1
        patch.model_of_call = model
        logp, entropy, is_top1 = _outside_compile(
            functools.partial(_named, patch.address, _per_token), patch, hidden[mask], lm_head,
            labels[mask], temperature, top1, fp32_head)
        # Zero on ignored positions, as TRL's (masked_scatter keeps a micro-batch with no
        # valid label connected to the graph).
        logp, entropy = (v.new_zeros(mask.shape).masked_scatter(mask, v)
                         for v in (logp, entropy))
        if is_top1 is not None:
            is_top1 = torch.zeros_like(mask).masked_scatter(mask, is_top1)
        denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-logp.sum() / denom, log_probs=logp, entropy=entropy,
                                   is_top1=is_top1, label_mask=mask)

    return forward


def apply_lossd(trainer, client_or_address, *, timeout=None, connect_timeout=10.0,
                cache_weights=True, keep_ms=DEFAULT_KEEP_MS):
    """Makes `trainer` (a trl.SFTTrainer or trl.GRPOTrainer, constructed) compute its
    per-token log-probs and entropies through lossd; returns the TrlPatch (remove() undoes
    it). Call it after the trainer's construction and before train().

    client_or_address: "host:port", a lossd.Client or a lossd.ReplicaPool (reached once here).
    keep_ms: how long the server keeps X between the forward and the backward (two-phase
      log-prob; 0: backward sends X again). cache_weights: the head by handle while unchanged.
    GRPO's temperature is the trainer's; TRL's cast_lm_head_to_fp32 is honoured.
    """
    kind = _trainer_kind(trainer)
    models = [("model", trainer.model)]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(("ref_model", trainer.ref_model))
    models = [(n, m.get_base_model() if hasattr(m, "get_base_model") else m) for n, m in models]
    for n, m in models:
        _check_model(m, n)
    client, address = _connect(client_or_address, timeout, connect_timeout)
    runtime = LossdRuntime(client=client, cache_weights=cache_weights, timeout=timeout)
    patch = TrlPatch(trainer, client, address, runtime, keep_ms)
    temperature = float(getattr(trainer, "temperature", 1.0))
    fp32_head = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    for n, m in models:
        patch._saved.append((m, m.forward))
        m.forward = _fused_forward(patch, m, m.forward, n, temperature, TRAINERS[kind],
                                   fp32_head)
        m._lossd_trl_patch = patch
        patch.models.append(m)
    return patch


__all__ = ["TRAINERS", "TrlPatch", "apply_lossd"]
