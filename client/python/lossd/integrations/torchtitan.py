# SPDX-License-Identifier: Apache-2.0
"""lossd inside torchtitan: apply_lossd(trainer_or_model, server) makes torchtitan's loss (its
CrossEntropyLoss: the sum over the tokens not ignored, divided by the step's global count of
valid tokens) come from lossd's fused linear cross-entropy on the last hidden state and the
model's lm_head, the logits never formed.

torchtitan (0.3) has the seam already: a decoder with `_skip_lm_head = True` returns its last
hidden state instead of the logits, and its ChunkedLossWrapper is a loss with
`set_lm_head(lm_head)` called as `loss_fn(pred, labels, global_valid_tokens)` returning
(loss, metrics). LossdLoss is such a loss; apply_lossd sets the model's `_skip_lm_head`,
gives the loss its lm_head and, given a torchtitan Trainer, puts it in `trainer.loss_fn`.
Imports torch only (torchtitan is not imported).
"""

import collections

import torch

from lossd import errors
from lossd.nn import LossdRuntime, lossd_fused_linear_cross_entropy
from lossd.integrations.transformers import (
    _compute_dtype, _connect, _named, _refuse_sharded, _under_fsdp, _zero3)

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


class LossdLoss:
    """torchtitan's loss interface (BaseLoss.__call__, ChunkedLossWrapper.set_lm_head):
    loss_fn(pred (B, L, D) hidden states, labels (B, L), global_valid_tokens) -> (loss,
    {}), the loss lossd's sum of cross-entropy over labels not IGNORE_INDEX, divided by
    global_valid_tokens when given. `calls` counts them; `remove()` puts the model's head
    back into its forward."""

    def __init__(self, client, address, runtime):
        self.client, self.address, self.runtime = client, address, runtime
        self.lm_head = None
        self.model = None
        self.calls = collections.Counter()
        self._inline = None

    def set_lm_head(self, lm_head):
        self.lm_head = lm_head

    def _runtime_for(self, cast):
        # A head cast or copied for this call is a new tensor every micro-batch: inline.
        if not cast:
            return self.runtime
        if self._inline is None:
            self._inline = LossdRuntime(client=self.client, cache_weights=False,
                                        timeout=self.runtime.timeout)
        return self._inline

    def __call__(self, pred, labels, global_valid_tokens=None, **loss_inputs):
        if self.lm_head is None:
            raise errors.FailedPreconditionError(
                "LossdLoss has no lm_head: call set_lm_head(model.lm_head) (apply_lossd does)",
                method="apply_lossd")
        if pred.shape[-1] != self.lm_head.weight.shape[-1]:
            raise errors.InvalidArgumentError(
                "pred's last dimension is %d, lm_head's in_features %d: the model must return "
                "its last hidden state (_skip_lm_head = True), not the logits" % (
                    pred.shape[-1], self.lm_head.weight.shape[-1]), method="apply_lossd")
        w, b = self.lm_head.weight, getattr(self.lm_head, "bias", None)
        _refuse_sharded(w, "torchtitan's loss")
        zero3 = _zero3(w, "torchtitan's loss")
        dtype = _compute_dtype(pred)
        x, w, b = (None if t is None else (t if t.dtype == dtype else t.to(dtype))
                   for t in (pred, w, b))
        if (self.model is not None and _under_fsdp(self.model, self.lm_head.weight)
                and w is self.lm_head.weight):
            # As lossd.integrations.transformers: FSDP frees the gathered head's storage.
            w, b = w.clone(), None if b is None else b.clone()
        self.calls["loss"] += 1
        h = x.shape[-1]
        loss = _named(self.address, _loss_outside_compile, x.reshape(-1, h), w,
                      labels.reshape(-1), b,
                      self._runtime_for(zero3 or w is not self.lm_head.weight))
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}

    def remove(self):
        if self.model is not None:
            self.model._skip_lm_head = False
        for rt in (self.runtime, self._inline):
            if rt is not None:
                rt.close()


@torch.compiler.disable
def _loss_outside_compile(x, w, t, b, runtime):
    # A gRPC call: under torch.compile it runs eagerly (one graph break).
    return lossd_fused_linear_cross_entropy(x, w, t, b, ignore_index=IGNORE_INDEX,
                                            reduction="sum", runtime=runtime)


def apply_lossd(trainer_or_model, client_or_address, *, timeout=None, connect_timeout=10.0,
                cache_weights=True):
    """Returns a LossdLoss for a torchtitan decoder (one with `lm_head` and `_skip_lm_head`,
    as torchtitan's Llama 3, Qwen 3, DeepSeek V3 have): the model now returns its last hidden
    state and the loss computes the head on lossd. Given a torchtitan Trainer (its
    `model_parts[0]` the whole model, no pipeline parallelism), also sets `trainer.loss_fn`.
    A head sharded as a DTensor at the loss (a fully_shard group of its own, tensor
    parallelism) is refused when the loss is called."""
    trainer = None
    model = trainer_or_model
    if hasattr(trainer_or_model, "model_parts"):
        trainer = trainer_or_model
        if len(trainer.model_parts) != 1:
            raise errors.InvalidArgumentError(
                "pipeline parallelism (%d model parts) is not covered" % len(
                    trainer.model_parts), method="apply_lossd")
        model = trainer.model_parts[0]
    if not hasattr(model, "_skip_lm_head") or getattr(model, "lm_head", None) is None:
        raise errors.InvalidArgumentError(
            "%s is not a torchtitan decoder with lm_head and _skip_lm_head" % type(
                model).__name__, method="apply_lossd")
    client, address = _connect(client_or_address, timeout, connect_timeout)
    loss = LossdLoss(client, address, LossdRuntime(client=client, cache_weights=cache_weights,
                                                   timeout=timeout))
    loss.set_lm_head(model.lm_head)
    loss.model = model
    model._skip_lm_head = True
    if trainer is not None:
        trainer.loss_fn = loss
    return loss


__all__ = ["IGNORE_INDEX", "LossdLoss", "apply_lossd"]
