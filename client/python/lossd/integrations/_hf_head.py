# SPDX-License-Identifier: Apache-2.0
"""Mode "head" of lossd.integrations.transformers: the module that stands in for a causal LM's
lm_head once lossd hosts it, and the Trainer callback that steps the hosted head. Imports torch
and transformers; never holds the head's weights as parameters (nothing here is trained
locally).
"""

import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from lossd import errors
from lossd.nn import RemoteLMHead, _to_torch


def refuse_tied(model):
    """A hosted head owns its weights on the server; a head tied to the input embedding shares
    them with the embedding lookup, which stays on the trainer, and the two would part after
    the first step."""
    emb = model.get_input_embeddings()
    w = model.lm_head.weight
    tied = emb is not None and getattr(emb, "weight", None) is not None and (
        emb.weight is w or emb.weight.data_ptr() == w.data_ptr())
    if tied:
        raise errors.FailedPreconditionError(
            "mode \"head\" cannot host %s's lm_head: its weight is the input embedding's "
            "(tie_word_embeddings). The hosted head's weights live and step on lossd while the "
            "embedding lookup needs the same matrix on the trainer, so the two would part "
            "after the first step. Build the model with tie_word_embeddings=False, or use "
            "mode \"loss\" (the head stays a parameter of the model)" % type(model).__name__,
            method="apply_lossd")


class HostedLMHead(torch.nn.Module):
    """Stands in for the model's lm_head: `head` (a lossd.nn.RemoteLMHead) computes the loss
    from the hidden states; called as a layer (a forward without labels: evaluation of
    logits, generation) it returns logits from the head's current compute copy, fetched once
    per version. Has no parameters: the model's optimizer no longer sees the head."""

    def __init__(self, head, in_features, out_features, compute_dtype):
        super().__init__()
        self.head = head
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        self._copy = None  # (version, weight, bias) of the fetched compute copy

    def forward(self, hidden):
        if self._copy is None or self._copy[0] != self.head.version:
            got = self.head.export(tensors=("copy_w", "copy_bias")).tensors
            b = got.get("copy_bias")
            self._copy = (self.head.version, _to_torch(got["copy_w"], None),
                          None if b is None else _to_torch(b, None))
        _, w, b = self._copy
        w = w.to(hidden.device)
        b = None if b is None else b.to(hidden.device)
        return F.linear(hidden.to(w.dtype), w, b)

    def extra_repr(self):
        return "in_features=%d, out_features=%d, hosted on lossd as %r" % (
            self.in_features, self.out_features, self.head.name)


def make_hosted_head(model, client, name, softcap, optimizer, compute_dtype, head_options):
    """The RemoteLMHead created from the model's current lm_head, and its stand-in layer."""
    if not name:
        raise errors.InvalidArgumentError(
            "mode \"head\" needs head_name: every data-parallel rank must name the same head "
            "(1-128 of [A-Za-z0-9._:/-])", method="apply_lossd")
    fixed = {"reduction", "ignore_index", "softcap", "return_z_loss", "return_token_accuracy",
             "return_predicted_tokens"}
    clash = sorted(fixed & set(head_options))
    if clash:
        raise errors.InvalidArgumentError(
            "%s: set by apply_lossd from the model (the loss must stay the model's own)" % (
                ", ".join(clash)), method="apply_lossd")
    lm_head = model.lm_head
    cdt = compute_dtype if compute_dtype is not None else lm_head.weight.dtype
    head = RemoteLMHead(name, lm_head.weight.detach(),
                        None if lm_head.bias is None else lm_head.bias.detach(), client=client,
                        optimizer=optimizer, compute_dtype=cdt, reduction="sum",
                        softcap=softcap, **head_options)
    layer = HostedLMHead(head, lm_head.in_features, lm_head.out_features, cdt)
    return head, layer


class HostedHeadCallback(TrainerCallback):
    """Steps the hosted head right after Trainer's optimizer step, at the learning rate that
    step used (the first parameter group's), so Trainer's scheduler drives both."""

    def __init__(self, head_optimizer):
        self.head_optimizer = head_optimizer

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            self.head_optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]
        self.head_optimizer.step()
