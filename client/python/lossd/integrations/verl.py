# SPDX-License-Identifier: Apache-2.0
"""lossd inside verl: apply_lossd(model, server) serves the path behind verl's
`use_fused_kernels` (the actor's and the reference's log-probs and entropy at a temperature,
from the hidden states and the head, the logits never formed) from lossd.

verl (0.9) turns `use_fused_kernels` on by replacing the causal LM's class forward
(verl.models.transformers.monkey_patch.patch_forward_with_backends) with
`forward_with_torch_backend` or `forward_with_triton_backend`: the base model, the labels
rolled by one (`torch.roll(input_ids, -1)`, or the `shift_labels` verl prepared), then
FusedLinearForPPO(hidden_states, lm_head.weight, rolled, temperature), returning a
CausalLMOutputForPPO with `log_probs` (fp32) and `entropy` (the hidden states' dtype). The
actor then calls `model(input_ids=..., temperature=..., return_dict=True)` and reads
`.log_probs` and `.entropy`.

apply_lossd replaces this model instance's forward (not the class's) with the same
computation through lossd.rl.fused_linear_for_ppo: the two-phase log-prob (X crosses once;
backward sends dlogp and dentropy under the forward's ticket and gets dX and dW). It needs
neither verl nor ray: the output is the same dataclass shape, made here.
Imports torch and transformers.
"""

import collections
import functools
from dataclasses import dataclass
from typing import Optional

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from lossd import errors
from lossd._rl_logprob import DEFAULT_KEEP_MS
from lossd.nn import LossdRuntime
from lossd.rl import fused_linear_for_ppo
from lossd.integrations.transformers import (
    _connect, _inline_runtime, _named, _refuse_sharded, _under_fsdp, _zero3)


@dataclass
class CausalLMOutputForPPO(CausalLMOutputWithPast):
    """verl's CausalLMOutputForPPO: the model's output with per-token log_probs and entropy."""

    log_probs: Optional[torch.FloatTensor] = None
    entropy: Optional[torch.FloatTensor] = None


class VerlPatch:
    """What apply_lossd did to one model: `runtime`, `calls` (forwards through lossd),
    `remove()`."""

    def __init__(self, model, client, address, runtime, keep_ms):
        self.model, self.client, self.address = model, client, address
        self.runtime, self.keep_ms = runtime, keep_ms
        self.calls = collections.Counter()
        self._saved = None
        self._inline = None  # the runtime sending W inline (a ZeRO-3 head), made on first use

    def remove(self):
        model = self.model
        if getattr(model, "_lossd_verl_patch", None) is not self:
            return
        if self._saved is not None:
            model.forward = self._saved
        else:
            del model.forward  # the class's forward again
        model._lossd_verl_patch = None
        for rt in (self.runtime, self._inline):
            if rt is not None:
                rt.close()

    def per_token(self, hidden, rolled, temperature):
        lm_head = self.model.lm_head
        w, b = lm_head.weight, lm_head.bias
        _refuse_sharded(w, "verl's fused kernels")
        runtime = _inline_runtime(self) if _zero3(w, "verl's fused kernels") else self.runtime
        if _under_fsdp(self.model, w):
            # As lossd.integrations.transformers: FSDP frees the gathered head's storage,
            # which the client's numpy view would have pinned. The copy is new each call:
            # inline.
            w, b = w.clone(), None if b is None else b.clone()
            runtime = _inline_runtime(self)
        self.calls["ppo"] += 1
        return _named(self.address, fused_linear_for_ppo, hidden, w, rolled, temperature,
                      bias=b, runtime=runtime, keep_ms=self.keep_ms)


@torch.compiler.disable
def _outside_compile(fn, *args):
    return fn(*args)


def _forward(patch, model):
    """verl's forward_with_torch_backend with FusedLinearForPPO served by lossd."""

    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, cache_position=None,
                logits_to_keep=0, temperature=1.0, shift_labels=None, **loss_kwargs):
        if not return_dict:
            raise errors.InvalidArgumentError(
                "a model patched by lossd.integrations.verl returns a dict only (verl's "
                "actor passes return_dict=True)", method="apply_lossd")
        outputs = model.model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, past_key_values=past_key_values,
                              inputs_embeds=inputs_embeds, use_cache=use_cache,
                              output_attentions=output_attentions,
                              output_hidden_states=output_hidden_states,
                              cache_position=cache_position)
        if shift_labels is not None:
            rolled = shift_labels
        elif labels is not None:
            rolled = torch.roll(labels, shifts=-1, dims=-1)
        elif input_ids is not None:
            rolled = torch.roll(input_ids, shifts=-1, dims=-1)
        else:
            raise errors.InvalidArgumentError(
                "give labels, shift_labels or input_ids (the log-probs are of the next token)",
                method="apply_lossd")
        log_probs, entropy = _outside_compile(patch.per_token, outputs[0], rolled,
                                              float(temperature))
        return CausalLMOutputForPPO(log_probs=log_probs, entropy=entropy,
                                    past_key_values=outputs.past_key_values,
                                    hidden_states=outputs.hidden_states,
                                    attentions=outputs.attentions)

    return forward


def apply_lossd(model, client_or_address, *, timeout=None, connect_timeout=10.0,
                cache_weights=True, keep_ms=DEFAULT_KEEP_MS):
    """Makes `model` (a text causal LM whose forward is base model -> lm_head, as verl's
    dense_common forward assumes: Llama, Qwen2/3, Mistral, ...) answer verl's fused-kernel
    calls through lossd; returns the VerlPatch. Call it where verl would call
    patch_forward_with_backends(model, use_fused_kernels=True), on the actor's (and the
    reference's) module before FSDP wraps it.

    client_or_address: "host:port", a lossd.Client or a lossd.ReplicaPool (reached once here).
    keep_ms: how long the server keeps X for the backward (0: backward sends X again).
    """
    if getattr(model, "_lossd_verl_patch", None) is not None:
        raise errors.FailedPreconditionError(
            "apply_lossd was already applied to this model; call remove() first",
            method="apply_lossd")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or not hasattr(model, "model"):
        raise errors.InvalidArgumentError(
            "%s: verl's fused path needs a causal LM with .model (the base model) and an "
            "nn.Linear .lm_head" % type(model).__name__, method="apply_lossd")
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        raise errors.InvalidArgumentError(
            "%s has final_logit_softcapping=%r, which verl's fused path ignores and lossd's "
            "log-prob does not take: not covered" % (type(model).__name__, cap),
            method="apply_lossd")
    client, address = _connect(client_or_address, timeout, connect_timeout)
    patch = VerlPatch(model, client, address,
                      LossdRuntime(client=client, cache_weights=cache_weights,
                                   timeout=timeout), keep_ms)
    patch._saved = model.__dict__.get("forward")
    model.forward = functools.update_wrapper(_forward(patch, model), type(model).forward,
                                             assigned=("__doc__", "__name__"))
    model._lossd_verl_patch = patch
    return patch


__all__ = ["CausalLMOutputForPPO", "VerlPatch", "apply_lossd"]
