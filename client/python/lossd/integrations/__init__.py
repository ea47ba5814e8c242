# SPDX-License-Identifier: Apache-2.0
"""lossd inside the training frameworks people already use. Importing this package imports
nothing heavy: each framework's hook lives in its own module, loaded on first use, and needs
that framework installed (`pip install "lossd[integrations]"`).

Hugging Face Transformers (lossd.integrations.transformers):

    from lossd.integrations import apply_lossd
    model = AutoModelForCausalLM.from_config(config)
    apply_lossd(model, "lossd:50051")            # the loss (forward with labels) on lossd

TRL (lossd.integrations.trl): apply_lossd(trainer, "lossd:50051") after building an
SFTTrainer or GRPOTrainer: its per-token log-probs and entropies come from lossd.

verl (lossd.integrations.verl): apply_lossd(actor_module, "lossd:50051") where verl would turn
on use_fused_kernels: log-probs and entropy at a temperature from lossd.

torchtitan (lossd.integrations.torchtitan): apply_lossd(trainer, "lossd:50051") sets its
loss_fn to lossd's cross-entropy on the last hidden state and lm_head.

docs/integrations.md lists the modes, what each sends per micro-batch and what is not covered.
"""


def apply_lossd(model, client_or_address, mode="loss", **kwargs):
    """lossd.integrations.transformers.apply_lossd: a Hugging Face causal LM's loss (and, with
    mode="head", its head) computed by lossd. Imports torch and transformers."""
    from lossd.integrations import transformers as _hf

    return _hf.apply_lossd(model, client_or_address, mode=mode, **kwargs)


__all__ = ["apply_lossd"]
