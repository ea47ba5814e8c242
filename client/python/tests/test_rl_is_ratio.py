# SPDX-License-Identifier: Apache-2.0
"""lossd.rl's GRPO loss with Liger's vllm_is_ratio (the trainer / rollout correction, a
per-token factor on the policy term, or with vespo a term of the sequence's weight, sent as
the policy kind's is_ratio): against torch
float64 autograd of Liger's formulas and against Liger-Kernel 0.8.5's own module, through the
float64 reference client and a server listing "policy_is_ratio" (test_rl_torch's backends).
"""

import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd import rl  # noqa: E402
from rl_torch_reference import ReferenceClient, as64, logprob_entropy, policy_loss  # noqa: E402
from test_rl_torch import (B, H, S, backend, expect_close, expect_grads, needs,  # noqa: E402,F401
                           ref_leaves, sequence_level_inputs)


def skip_without_feature(make, fake):
    if fake is None and "policy_is_ratio" not in set(make().client.server_info().features):
        pytest.skip("the server does not compute is_ratio")


def factors(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return 0.2 + 1.8 * torch.rand(*shape, generator=g)  # in [0.2, 2): truncated-looking


@needs("policy")
@pytest.mark.parametrize("loss_type, level, per_sequence", [
    ("dapo", "token", False), ("cispo", "token", False), ("sapo", "token", True),
    ("grpo", "sequence", False), ("luspo", "token", False), ("vespo", "token", False),
    ("vespo", "token", True)])
def test_is_ratio_matches_torch(backend, loss_type, level, per_sequence):
    make, fake = backend
    skip_without_feature(make, fake)
    x3, w, b, ids, mask, adv, old, ref = sequence_level_inputs(97)
    rho = factors((B, 1) if per_sequence else (B, S), 98)
    eps_high = 5.0 if loss_type == "cispo" else 0.3
    args = dict(beta=0.05, epsilon_low=0.2, epsilon_high=eps_high, loss_type=loss_type,
                temperature=1.2, importance_sampling_level=level)
    module = rl.LossdFusedLinearGRPOLoss(runtime=make(), **args)
    loss, (kl, clip) = module(x3, w, ids, mask, adv, bias=b, ref_per_token_logps=ref,
                              old_per_token_logps=old, vllm_is_ratio=rho)
    (2.0 * loss).backward()
    rx, rw, rb = ref_leaves(x3.reshape(-1, H), w, b)
    rlogp, _ = logprob_entropy(rx, rw, rb, ids.reshape(-1), 1.2)
    opts = dict(dapo_normalizer=0.0, max_completion_length=0, importance_sampling=level,
                **{k: v for k, v in args.items()
                   if k not in ("temperature", "importance_sampling_level")})
    rloss, rkl, rclip = policy_loss(rlogp, as64(mask).reshape(-1), as64(adv).repeat_interleave(S),
                                    as64(old), as64(ref), opts, B,
                                    # vespo sums Liger's (B, 1) once: it goes as it is
                                    as64(rho if loss_type == "vespo" else rho.expand(B, S)
                                         ).reshape(-1))
    (2.0 * rloss).backward()
    expect_close("loss", loss, rloss.detach())
    expect_close("kl", kl, rkl, atol=1e-4)
    expect_close("clip_fraction", clip, rclip, rtol=1e-6, atol=0)
    expect_grads([("dx", x3, rx), ("dw", w, rw), ("db", b, rb)])
    if fake is not None:
        assert fake.calls[-1]["has_is_ratio"]


@needs("policy")
@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("bnpo", "sequence")])
def test_is_ratio_matches_ligers_module(backend, loss_type, level):
    from test_rl_reference_torch import import_liger
    grpo = import_liger("liger_kernel.chunked_loss.grpo_loss")
    make, fake = backend
    skip_without_feature(make, fake)
    x3, w, b, ids, mask, adv, old, ref = sequence_level_inputs(99)
    rho = factors((B, S), 100)
    args = dict(beta=0.05, epsilon_low=0.2, epsilon_high=0.3, loss_type=loss_type,
                temperature=1.2, compiled=False, importance_sampling_level=level)
    results = []
    for module in (rl.LossdFusedLinearGRPOLoss(runtime=make(), **args),
                   grpo.LigerFusedLinearGRPOLoss(**args)):
        now = [t.detach().clone().requires_grad_(True) for t in (x3, w, b)]
        loss, metrics = module(now[0], now[1], ids, mask, adv, bias=now[2],
                               ref_per_token_logps=ref, old_per_token_logps=old,
                               vllm_is_ratio=rho)
        loss.backward()
        results.append((loss.detach(), [m.detach() for m in metrics], [t.grad for t in now]))
    (loss, metrics, grads), (lloss, lmetrics, lgrads) = results
    expect_close("loss", loss, lloss, rtol=0, atol=2e-5)
    expect_close("kl", metrics[0], lmetrics[0], rtol=0, atol=2e-5)
    expect_close("clip_fraction", metrics[1], lmetrics[1], rtol=1e-6, atol=0)
    for name, got, want in zip(("dx", "dw", "db"), grads, lgrads):
        expect_close(name, got, want, rtol=0, atol=2e-5)


def test_is_ratio_shape_is_checked():
    module = rl.LossdFusedLinearGRPOLoss(client=ReferenceClient())
    x3, w, b, ids, mask, adv, old, ref = sequence_level_inputs(101)
    with pytest.raises(lossd.InvalidArgumentError,
                       match=r"vllm_is_ratio must be \(B, S\) = \(4, 6\) or \(B, 1\), got \(4, 5\)"):
        module(x3, w, ids, mask, adv, vllm_is_ratio=torch.ones(B, S - 1))
