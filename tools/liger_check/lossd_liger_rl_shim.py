# SPDX-License-Identifier: Apache-2.0
"""A pytest plugin that runs Liger-Kernel's own GRPO and JSD loss tests against lossd.rl.

Loaded with `-p lossd_liger_rl_shim` (run_rl.sh beside this file does it), before pytest
imports test/chunked_loss/test_grpo_loss.py and test_jsd_loss.py: it starts a lossd server on
loopback (lossd_liger_shim's) and makes the names those files take from Liger resolve to
lossd.rl's:

- liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss -> lossd.rl.LossdFusedLinearGRPOLoss;
- liger_kernel.chunked_loss.functional.liger_fused_linear_grpo -> the same module, called
  with LigerFusedLinearGRPOFunction.apply's positional arguments;
- liger_kernel.chunked_loss.fused_linear_ppo.LigerFusedLinearPPOBase -> a subclass whose
  chunk_forward (the selected tokens' log-probs) is lossd.rl.logprobs_from_hidden;
- liger_kernel.chunked_loss.LigerFusedLinearJSDLoss -> lossd.rl.LossdFusedLinearJSDLoss;
- liger_kernel.chunked_loss.functional.liger_fused_linear_jsd -> lossd.rl.fused_linear_jsd_loss.

LigerFusedLinearGRPOFunction and LigerFusedLinearJSDFunction stay Liger's own: the functional
tests compare them with the function above, so there lossd is checked against Liger's CPU path
itself. Liger's files are never edited.

Where a test asks for what lossd does not build, the test reports itself skipped with the
reason (UNBUILT below), never passes without comparing: the shim skips before lossd is called.
Tests of Liger's internals that no lossd entry point replaces (its Triton kernel, a helper of
it, spies on calls inside Liger's chunk loop) are skipped by name (LIGER_INTERNALS).

Env: LOSSD_BIN (the lossd binary; required), LOSSD_LIGER_BACKEND (the server's --backend,
default cpu; cuda on a GPU host).
"""

import inspect

import pytest
import torch

import lossd_liger_shim as base
from lossd import rl as lossd_rl
from lossd.nn import LossdRuntime

# Test functions that check Liger's own internals, not an entry point lossd stands in for.
LIGER_INTERNALS = {
    "test_reduce_grpo_loss_matches_reference":
        "tests _reduce_grpo_loss, a helper of Liger's Triton GRPO path; lossd replaces no "
        "part of it",
    "test_reduce_grpo_loss_requires_max_completion_length":
        "tests _reduce_grpo_loss, a helper of Liger's Triton GRPO path; lossd replaces no "
        "part of it",
    "test_triton_grpo_loss_matches_reference":
        "tests Liger's Triton kernel over materialised logits (a GPU path); lossd takes the "
        "hidden states and the head, never logits",
    "test_selective_logprob_backward_skips_frozen_params":
        "spies on _selective_logprob_backward inside Liger's chunk loop; lossd computes on "
        "the server (test_grpo_frozen_lm_head checks the frozen head through lossd)",
    "test_jsd_hard_loss_computed_only_when_used":
        "spies on torch's nll_loss inside Liger's chunk loop, and asks for "
        "return_soft_hard_loss=True, which lossd does not build (the server returns the "
        "weighted loss only)",
}

# Options lossd does not build: (argument, value) -> why. Checked on every module and
# function call before lossd is called; the test then reports itself skipped.
UNBUILT = {
    ("return_soft_hard_loss", True): "the server returns the weighted loss only",
}


# Where lossd differs from Liger, on purpose or not yet built: the test is expected to fail,
# strictly (a pass fails the run, so the entry goes when lossd changes).
DIVERGENCES = {
    "test_sequence_level_rejects_unsupported_loss_types":
        "on purpose: lossd refuses the sequence level with cispo or sapo at construction, with Liger's "
        "message and a ValueError; Liger raises at forward, and the test constructs outside "
        "pytest.raises (docs/rl_clients.md: GRPO's argument checks run at construction)",
}

# luspo: lossd leaves masked tokens out of the loss; Liger's multiplies each token by its
# sequence's mask count without its own mask, so padding enters Liger's loss and gradient.
LUSPO_PADDING = ("lossd's luspo leaves masked tokens out; Liger's counts padded tokens in "
                 "(docs/rl_losses.md), and this call has padding: the two differ by design")


def _skip_unbuilt(**arguments):
    for (name, value), why in UNBUILT.items():
        if name in arguments and arguments[name] == value and type(arguments[name]) is type(value):
            pytest.skip("lossd does not build %s=%r: %s" % (name, value, why))


def _runtime():
    # Weights go inline: each test makes new ones, and a handle per module would only fill
    # the server's cache.
    return LossdRuntime(client=base._state["client"], cache_weights=False)


_GRPO_INIT = inspect.signature(lossd_rl.LossdFusedLinearGRPOLoss.__init__)


class LigerFusedLinearGRPOLoss(lossd_rl.LossdFusedLinearGRPOLoss):
    """LigerFusedLinearGRPOLoss's constructor (positional or keyword) on lossd's module."""

    def __init__(self, *args, **kwargs):
        bound = _GRPO_INIT.bind_partial(self, *args, **kwargs)
        bound.apply_defaults()
        _skip_unbuilt(**bound.arguments)
        super().__init__(*args, runtime=_runtime(), **kwargs)

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, *args, **kwargs):
        if self.loss_type == "luspo" and not bool(attention_mask.bool().all()):
            pytest.skip(LUSPO_PADDING)
        return super().forward(_input, lin_weight, selected_token_ids, attention_mask, *args,
                               **kwargs)


# LigerFusedLinearGRPOFunction.forward's arguments after ctx, in order (Liger-Kernel 0.8.5).
_GRPO_FUNCTION_ARGS = (
    "_input", "weight", "selected_token_ids", "attention_mask", "advantages", "bias",
    "ref_per_token_logps", "old_per_token_logps", "ref_input", "ref_weight", "ref_bias", "beta",
    "epsilon_low", "epsilon_high", "loss_type", "max_completion_length",
    "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg", "temperature",
    "compiled", "use_ref_model", "chunk_size", "vllm_is_ratio", "delta", "use_bias_correction_kl",
    "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "num_items_in_batch")
_FORWARD_ARGS = ("_input", "weight", "selected_token_ids", "attention_mask", "advantages", "bias",
                 "ref_per_token_logps", "old_per_token_logps", "ref_input", "ref_weight",
                 "ref_bias", "vllm_is_ratio", "num_items_in_batch")


def liger_fused_linear_grpo(*args):
    """LigerFusedLinearGRPOFunction.apply's positional arguments, on lossd's module."""
    defaults = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="dapo",
                    max_completion_length=None, importance_sampling_level="token",
                    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0,
                    compiled=True, use_ref_model=True, chunk_size=1)
    given = dict(defaults, **dict(zip(_GRPO_FUNCTION_ARGS, args)))
    _skip_unbuilt(**given)
    ctor = {k: v for k, v in given.items() if k not in _FORWARD_ARGS}
    if ctor["loss_type"] != "sapo":
        # Liger's Function reads the sapo temperatures for sapo only and checks them nowhere
        # (its test_functional_correctness passes False there, one place off); lossd's
        # module checks them as Liger's module does, so they go only where they are read.
        ctor.pop("sapo_temperature_pos")
        ctor.pop("sapo_temperature_neg")
    module = LigerFusedLinearGRPOLoss(**ctor)
    fwd = [given.get(k) for k in _FORWARD_ARGS]
    return module(*fwd[:11], vllm_is_ratio=fwd[11], num_items_in_batch=fwd[12])


def _ppo_base_with_lossd_logprobs(liger_ppo_base):
    class LigerFusedLinearPPOBase(liger_ppo_base):
        @staticmethod
        def chunk_forward(input_chunk, weight, selected_token_ids, bias=None, temperature=1.0):
            return lossd_rl.logprobs_from_hidden(input_chunk, weight, selected_token_ids,
                                                 temperature, bias=bias, runtime=_runtime())

    return LigerFusedLinearPPOBase


class LigerFusedLinearJSDLoss(lossd_rl.LossdFusedLinearJSDLoss):
    """LigerFusedLinearJSDLoss's constructor (positional or keyword) on lossd's module."""

    def __init__(self, *args, **kwargs):
        sig = inspect.signature(lossd_rl.LossdFusedLinearJSDLoss.__init__)
        bound = sig.bind_partial(self, *args, **kwargs)
        bound.apply_defaults()
        _skip_unbuilt(**bound.arguments)
        super().__init__(*args, runtime=_runtime(), **kwargs)


def liger_fused_linear_jsd(*args):
    """LigerFusedLinearJSDFunction.apply's positional arguments, on lossd's function."""
    names = ("student_input", "student_weight", "teacher_input", "teacher_weight", "true_labels",
             "student_bias", "teacher_bias", "weight_hard_loss", "weight_soft_loss", "beta",
             "ignore_index", "temperature", "compiled", "chunk_size", "return_soft_hard_loss")
    _skip_unbuilt(**dict(zip(names, args)))
    return lossd_rl.fused_linear_jsd_loss(*args, runtime=_runtime())


_LIGERS = []  # (module, name, Liger's own value), put back once the test files are imported


def _point(module, name, value):
    _LIGERS.append((module, name, getattr(module, name)))
    setattr(module, name, value)


def pytest_configure(config):
    import liger_kernel.chunked_loss as liger_chunked
    import liger_kernel.chunked_loss.functional as liger_functional
    import liger_kernel.chunked_loss.fused_linear_ppo as liger_ppo

    base._start_server()
    _point(liger_chunked, "LigerFusedLinearGRPOLoss", LigerFusedLinearGRPOLoss)
    _point(liger_chunked, "LigerFusedLinearJSDLoss", LigerFusedLinearJSDLoss)
    _point(liger_functional, "liger_fused_linear_grpo", liger_fused_linear_grpo)
    _point(liger_functional, "liger_fused_linear_jsd", liger_fused_linear_jsd)
    _point(liger_ppo, "LigerFusedLinearPPOBase",
           _ppo_base_with_lossd_logprobs(liger_ppo.LigerFusedLinearPPOBase))


def pytest_collection_finish(session):
    # The test files hold lossd's names now. Liger's own code finds its names in its modules
    # (LigerFusedLinearGRPOFunction's forward calls LigerFusedLinearPPOBase.chunk_forward):
    # it gets its own back, so Liger's Functions, the functional tests' other side, stay
    # Liger's end to end.
    while _LIGERS:
        module, name, value = _LIGERS.pop()
        setattr(module, name, value)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = getattr(item, "originalname", item.name)
        if name in LIGER_INTERNALS:
            item.add_marker(pytest.mark.skip(
                reason="not a lossd entry point: " + LIGER_INTERNALS[name]))
        elif name in DIVERGENCES:
            item.add_marker(pytest.mark.xfail(
                strict=True, reason="lossd differs from Liger, " + DIVERGENCES[name]))


def pytest_unconfigure(config):
    base.pytest_unconfigure(config)
