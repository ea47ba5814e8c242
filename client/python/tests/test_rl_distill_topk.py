# SPDX-License-Identifier: Apache-2.0
"""lossd.rl's LossdTopkDistillLoss and topk_distill_loss (distillation from the teacher's top-k
ids and log-probs, no teacher head) and Client.compute's teacher_topk_ids / teacher_topk_logp,
through a CPU server listing "distill_topk", against torch float64 autograd of the formulas
(docs/rl_losses.md): forward KL, reverse KL and the JSD over the k ids and the tail's treatment
(bucket, renormalize, none), the temperature, the hard-label term, a bias, int32 ids; and what
the client and the server refuse.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd import rl  # noqa: E402
from lossd.nn import LossdRuntime  # noqa: E402
from rl_torch_reference import as64, hard_loss  # noqa: E402
from test_rl_torch import expect_close, expect_grads, leaves, ref_leaves  # noqa: E402

BT, H, V, K = 24, 16, 40, 5


@pytest.fixture
def runtime(client):
    if "distill_topk" not in set(client.server_info().features):
        pytest.skip("the server does not compute distillation from a top-k teacher")
    return LossdRuntime(client=client, cache_weights=True)


def teacher_topk(seed, k=K):
    """A random teacher (logits of std 2 over V) per row: its k most likely ids, in a shuffled
    order, and their log-probs (float32, as a trainer would store them)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(BT, V, generator=g, dtype=torch.float64) * 2, -1)
    ids = lp.topk(k, -1).indices
    perm = torch.stack([torch.randperm(k, generator=g) for _ in range(BT)])
    ids = ids.gather(1, perm)
    return ids, lp.gather(1, ids).float()


def divergence_rows(lq, ids, logp, beta, tail):
    """Each row's divergence at beta over its events, in float64 (lq: the student's (BT, V)
    log-probs at the temperature)."""
    lp = as64(logp)
    lqk = lq.gather(1, ids)
    if tail == "renormalize":
        lp, lqk = torch.log_softmax(lp, -1), torch.log_softmax(lqk, -1)
    elif tail == "bucket":
        listed = torch.zeros_like(lq, dtype=torch.bool).scatter(1, ids, True)
        lq_tail = torch.logsumexp(lq.masked_fill(listed, -torch.inf), -1, keepdim=True)
        lp_tail = torch.log1p(-lp.exp().sum(-1, keepdim=True))
        lp, lqk = torch.cat([lp, lp_tail], -1), torch.cat([lqk, lq_tail], -1)
    p, q = lp.exp(), lqk.exp()
    if beta == 0:
        return (p * (lp - lqk)).sum(-1)
    if beta == 1:
        return (q * (lqk - lp)).sum(-1)
    log_m = torch.logaddexp(lp + np.log(beta), lqk + np.log(1 - beta))
    return (beta * p * (lp - log_m) + (1 - beta) * q * (lqk - log_m)).sum(-1)


def reference_loss(x, w, b, ids, logp, labels, beta, tail, temperature, weights):
    logits = x @ w.T + (0 if b is None else b)
    lq = torch.log_softmax(logits / temperature, -1)
    keep = labels != -100
    rows = divergence_rows(lq, ids, logp, beta, tail)
    soft = (rows * keep).sum() / keep.sum()
    loss = weights[1] * soft
    if weights[0] != 0:
        loss = loss + weights[0] * hard_loss(x, w, b, labels, keep)
    return loss


CASES = [  # beta, tail, temperature, (w_hard, w_soft), bias, id dtype
    (0.0, "bucket", 1.0, (0.0, 1.0), False, torch.int64),
    (1.0, "bucket", 0.7, (0.0, 1.0), True, torch.int32),
    (0.5, "renormalize", 2.0, (0.0, 1.0), False, torch.int64),
    (1.0, "renormalize", 1.0, (0.0, 1.0), True, torch.int64),
    (0.0, "none", 1.0, (0.5, 0.8), False, torch.int64),
    (0.3, "bucket", 1.3, (0.3, 1.0), True, torch.int32),
]


@pytest.mark.parametrize("beta, tail, temperature, weights, with_bias, id_dtype", CASES)
def test_topk_loss_matches_torch(runtime, beta, tail, temperature, weights, with_bias,
                                 id_dtype):
    x, w, b = leaves((BT, H), (V, H), (V,), seed=11, scale=0.6)
    b = b if with_bias else None
    ids, logp = teacher_topk(12)
    labels = torch.randint(0, V, (BT,), generator=torch.Generator().manual_seed(13))
    labels[::5] = -100
    module = rl.LossdTopkDistillLoss(jsd_beta=beta, topk_tail=tail, temperature=temperature,
                                     weight_hard_loss=weights[0], weight_soft_loss=weights[1],
                                     runtime=runtime)
    loss = module(x, w, ids.to(id_dtype), logp, labels, b)
    (1.5 * loss).backward()
    rx, rw, rb = ref_leaves(x, w, b)
    rloss = reference_loss(rx, rw, rb, ids, logp, labels, beta, tail, temperature, weights)
    (1.5 * rloss).backward()
    assert rloss.item() > 0
    expect_close("loss", loss, rloss.detach())
    expect_grads([("dx", x, rx), ("dw", w, rw), ("db", b, rb)])


def test_function_equals_module_and_no_labels_count_every_row(runtime):
    x, w, b = leaves((BT, H), (V, H), (V,), seed=21, scale=0.6)
    ids, logp = teacher_topk(22)
    got = rl.topk_distill_loss(x, w, ids, logp, None, b, jsd_beta=0.2, topk_tail="renormalize",
                               temperature=1.1, runtime=runtime)
    want = rl.LossdTopkDistillLoss(0.2, "renormalize", temperature=1.1, runtime=runtime)(
        x, w, ids, logp, None, b)
    assert got.item() == want.item()
    rx, rw, rb = ref_leaves(x, w, b)
    every = torch.zeros(BT, dtype=torch.int64)
    expect_close("loss", got, reference_loss(rx, rw, rb, ids, logp, every, 0.2, "renormalize",
                                             1.1, (0.0, 1.0)).detach())


def test_client_compute_takes_the_topk_in_numpy(runtime):
    """Client.compute directly: numpy inputs, distill options as a dict, (BT, k) int64 ids."""
    x, w, _ = leaves((BT, H), (V, H), (V,), seed=31, scale=0.6)
    ids, logp = teacher_topk(32)
    r = runtime.client.compute(x.detach().numpy(), w.detach().numpy(), None, kind="distill",
                               distill={"jsd_beta": 0.0, "topk_tail": "none"},
                               teacher_topk_ids=ids.numpy(), teacher_topk_logp=logp.numpy())
    rx, rw = as64(x.detach()), as64(w.detach())
    every = torch.zeros(BT, dtype=torch.int64)
    want = reference_loss(rx, rw, None, ids, logp, every, 0.0, "none", 1.0, (0.0, 1.0))
    expect_close("loss", r.loss, want)
    assert r.tokens == BT


def test_refusals_name_the_field(runtime):
    x, w, _ = leaves((BT, H), (V, H), (V,), seed=41, scale=0.6)
    ids, logp = teacher_topk(42)
    with pytest.raises(lossd.InvalidArgumentError, match="topk_tail must be one of bucket, "
                                                         "renormalize, none, got 'top'"):
        rl.LossdTopkDistillLoss(topk_tail="top", runtime=runtime)
    with pytest.raises(lossd.InvalidArgumentError, match=r"jsd_beta must be in \[0, 1\], got 2"):
        rl.LossdTopkDistillLoss(jsd_beta=2, runtime=runtime)
    module = rl.LossdTopkDistillLoss(runtime=runtime)
    with pytest.raises(lossd.InvalidArgumentError, match="labels is None: weight_hard_loss 0.5"):
        rl.LossdTopkDistillLoss(weight_hard_loss=0.5, runtime=runtime)(x, w, ids, logp)
    with pytest.raises(lossd.InvalidArgumentError, match="distill.topk_tail must be one of"):
        runtime.client.compute(x.detach().numpy(), w.detach().numpy(), None, kind="distill",
                               distill={"topk_tail": "all"}, teacher_topk_ids=ids.numpy(),
                               teacher_topk_logp=logp.numpy())
    with pytest.raises(lossd.InvalidArgumentError, match="go with kind 'distill', not 'policy'"):
        runtime.client.compute(x.detach().numpy(), w.detach().numpy(), None, kind="policy",
                               teacher_topk_ids=ids.numpy(), teacher_topk_logp=logp.numpy())
    # The server's one validation names the row and the value.
    twice = ids.clone()
    twice[3, 1] = twice[3, 0]
    with pytest.raises(lossd.InvalidArgumentError,
                       match="teacher_topk_ids row 3 repeats id %d" % int(ids[3, 0])):
        module(x, w, twice, logp)
    bad = logp.clone()
    bad[2, 4] = float("nan")  # refused with the other inputs' non-finite values, flat index
    with pytest.raises(lossd.InvalidArgumentError,
                       match=r"teacher_topk_logp contains a non-finite value \(nan\) at \[14\]"):
        module(x, w, ids, bad)
    heavy = logp.clone()
    heavy[6] = np.log(0.5)  # five ids of probability 0.5: not one distribution's
    with pytest.raises(lossd.InvalidArgumentError,
                       match="teacher_topk_logp row 6: its probabilities sum to 2.5 > 1"):
        module(x, w, ids, heavy)
    # renormalize takes any log-probs
    assert rl.LossdTopkDistillLoss(topk_tail="renormalize", runtime=runtime)(
        x, w, ids, heavy).item() > 0
    with pytest.raises(lossd.InvalidArgumentError, match=r"teacher_topk_ids\[0, 2\] = 40 is "
                                                         r"outside \[0, V=40\)"):
        module(x, w, ids.index_fill(1, torch.tensor([2]), V), logp)
