# SPDX-License-Identifier: Apache-2.0
"""A policy loss whose KL term overflows fp32 (ref_logp - logp far above log(FLT_MAX) = 88.72
at one token), against a real lossd: lossd.rl's GRPO module returns what Liger-Kernel's does,
loss = inf and a non-finite dX, for the trainer to skip the step; the numpy client gets the
same with allow_nonfinite_loss (result.nonfinite names dx) and, without it, a refusal that
names the KL term, its row and its inputs, never the logits. Into an accumulator the refusal
stays. Skipped where torch is not installed or the server lacks the features."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd import rl  # noqa: E402
from lossd.nn import LossdRuntime  # noqa: E402

B, S, H, V = 2, 3, 8, 16
ROW = 4  # the flattened token whose reference log-prob is far above the policy's


@pytest.fixture
def client(client):
    features = set(client.server_info().features)
    for f in ("loss_kind_policy", "nonfinite_loss"):
        if f not in features:
            pytest.skip("the server lacks %s" % f)
    return client


def _batch(seed=5):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, S, H, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_(True)
    ids = torch.randint(0, V, (B, S), generator=g)
    adv = torch.randn(B, generator=g)
    ref = torch.full((B, S), -1.0)
    ref.view(-1)[ROW] = 300.0  # exp(300 - logp) is inf in fp32 (and beta times it in double)
    return x, w, ids, torch.ones(B, S), adv, ref


def test_grpo_module_returns_inf_loss_and_nonfinite_dx(client):
    x, w, ids, mask, adv, ref = _batch()
    module = rl.LossdFusedLinearGRPOLoss(beta=0.04, runtime=LossdRuntime(client=client))
    loss, (kl, _) = module(x, w, ids, mask, adv, ref_per_token_logps=ref)
    assert torch.isinf(loss) and loss.dtype == torch.float32
    loss.backward()
    assert not bool(torch.isfinite(x.grad).all())
    # The rows whose KL term is finite keep finite gradients: only the overflowed row is not.
    finite_rows = torch.isfinite(x.grad.reshape(-1, H)).all(dim=1)
    assert not bool(finite_rows[ROW]) and bool(finite_rows[:ROW].all())


def test_numpy_client_flags_dx_with_allow_and_names_the_kl_term_without(client):
    x, w, ids, _, adv, ref = _batch()
    args = (x.detach().reshape(-1, H), w.detach(), ids.reshape(-1))
    kw = dict(kind="policy", advantages=adv.repeat_interleave(S), ref_logp=ref.reshape(-1),
              policy={"beta": 0.04, "sequences": B}, want_dw=False)
    r = client.compute(*args, allow_nonfinite_loss=True, **kw)
    assert np.isinf(r.loss) and "dx" in r.nonfinite
    with pytest.raises(lossd.InvalidArgumentError) as e:
        client.compute(*args, **kw)
    m = e.value.message
    assert ("the loss is not finite (kind policy): the KL term exp(ref_logp - logp) overflows "
            "fp32 at row %d: ref_logp[%d] = 300, logp = " % (ROW, ROW)) in m, m
    assert "X W^T" not in m, m


def test_an_accumulator_keeps_its_refusal_naming_the_kl_term(client):
    x, w, ids, mask, adv, ref = _batch()
    rt = LossdRuntime(client=client, accumulator=True)
    module = rl.LossdFusedLinearGRPOLoss(beta=0.04, runtime=rt)
    try:
        # Deferred: forward computes the loss alone (answered, inf), backward adds into the
        # accumulator (refused: a sum cannot take the overflow).
        loss, _ = module(x, w, ids, mask, adv, ref_per_token_logps=ref)
        assert torch.isinf(loss)
        with pytest.raises(lossd.InvalidArgumentError,
                           match=r"the KL term exp\(ref_logp - logp\) overflows fp32 at row 4"):
            loss.backward()
    finally:
        rt.drop_accumulator()
        rt.close()
