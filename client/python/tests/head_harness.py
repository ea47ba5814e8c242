# SPDX-License-Identifier: Apache-2.0
"""What the hosted-head tests share: random heads and micro-batches, simulated data-parallel
ranks (threads, each with its own RemoteLMHead on one head, their Computes in a fixed order),
the summed gradient the server applied (the same Computes, in the same order, into an
accumulator), a local torch head stepped with it, and the ulp distance between fp32 arrays.
Import it after pytest.importorskip("torch")."""

import threading
import uuid

import numpy as np
import pytest
import torch

import lossd
from lossd._remote_head import _dx_dtype_opts
from lossd.nn import RemoteLMHead

V, H, BT = 67, 24, 19  # nothing a multiple of 8
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# The largest distance allowed between lossd's master (or optimizer state) and torch's after
# k steps: 2k fp32 ulps of the tensor's largest magnitude (ulps_of_max), the normwise form
# of an ulp bound. Why not 0: lossd runs torch's single-tensor operations in torch's order in
# fp32 with the same double scalars, but torch's vectorised CPU kernels fuse some of them
# (add(alpha=), lerp) into one fused multiply-add, one rounding where lossd's CPU backend
# rounds twice (and a CUDA build fuses where nvcc contracts). Each such operation moves its
# result by at most 1 ulp of its largest operand, which is no larger than the tensor's
# largest value (the gradient terms, weight decay and momentum terms are what the tensor is
# made of); a difference in a state tensor enters the parameter's update scaled by lr (far
# below an ulp); a difference carried into the next step is not amplified (every update is
# a contraction of what it updates: factors 1 - lr*wd, beta1, beta2, momentum). Two fused
# operations on a path per step, so 2 per step. Elementwise ulps (ulps) are printed too:
# where an update cancels a value to near zero they count the same difference in that
# element's much smaller spacing. A real error (a missed weight decay, a wrong bias
# correction or step count, a gradient added twice) is thousands of times larger.
ULPS_OF_MAX_PER_STEP = 2


def ulps_of_max(got, want):
    """max |got - want| in fp32 spacings of the largest magnitude in `want`."""
    got, want = np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)
    scale = np.spacing(np.float32(np.max(np.abs(want)))).astype(np.float64)
    return np.abs(got.astype(np.float64) - want.astype(np.float64)) / scale


def ulps(a, b):
    """Elementwise distance in fp32 units in the last place (the count of fp32 values between
    them), for arrays of finite fp32 values."""
    def ordered(x):
        i = np.ascontiguousarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    assert a.shape == b.shape, "shapes %s and %s" % (a.shape, b.shape)
    assert np.all(np.isfinite(a)) and np.all(np.isfinite(b)), "non-finite values"
    return np.abs(ordered(a) - ordered(b))


def unique(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:12])


def make_head(seed, bias=True, v=V, h=H):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g) * 2.0 / h ** 0.5
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    return w, b


def make_batch(seed, dtype="fp32", bt=BT, h=H, v=V, scale=1.0, ignore=True):
    """Hidden states (bt, h) of `dtype` and targets, a few ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(bt, h, generator=g) * scale).to(TORCH_DTYPES[dtype])
    t = torch.randint(0, v, (bt,), generator=g)
    if ignore:
        t[torch.randperm(bt, generator=g)[:2]] = -100
    return x, t


def torch_optimizer(kind, params_w, params_b, cfg):
    """torch.optim.SGD / AdamW (foreach=False, fused=False) over the weight and the bias,
    each its own group (the bias with bias_weight_decay), as the OptimizerConfig says."""
    groups = [{"params": [params_w], "weight_decay": cfg.weight_decay or 0.0}]
    if params_b is not None:
        groups.append({"params": [params_b], "weight_decay": cfg.bias_weight_decay})
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                               dampening=cfg.dampening, nesterov=cfg.nesterov,
                               foreach=False, fused=False)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas or (0.9, 0.999),
                             eps=cfg.eps if cfg.eps is not None else 1e-8,
                             amsgrad=cfg.amsgrad, foreach=False, fused=False)


class Reference:
    """The local torch head: fp32 parameters stepped by torch's optimizer with the gradient
    the server summed."""

    def __init__(self, w, b, cfg):
        self.w = torch.nn.Parameter(w.detach().clone().float())
        self.b = None if b is None else torch.nn.Parameter(b.detach().clone().float())
        self.opt = torch_optimizer(cfg.kind, self.w, self.b, cfg)

    def step(self, dw, db, coef=None, lr=None):
        self.w.grad = torch.from_numpy(np.array(dw))
        if self.b is not None:
            self.b.grad = torch.from_numpy(np.array(db))
        if coef is not None:  # as clip_grad_norm_ and GradScaler.unscale_ scale in place
            for p in (self.w, self.b):
                if p is not None:
                    p.grad.mul_(torch.tensor(coef, dtype=torch.float32))
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        self.opt.step()

    def state(self, p, name):
        return self.opt.state[p][name].detach().numpy()


class Turns:
    """A fixed arrival order of Computes across threads: wait(i) returns once turns 0..i-1
    are done; done() ends the current turn."""

    def __init__(self):
        self.cv = threading.Condition()
        self.n = 0

    def wait(self, i):
        with self.cv:
            if not self.cv.wait_for(lambda: self.n == i, timeout=120):
                raise TimeoutError("turn %d never came (at %d)" % (i, self.n))

    def done(self):
        with self.cv:
            self.n += 1
            self.cv.notify_all()


def run_ranks(n, body):
    """body(rank) on n threads at once; re-raises the first failure."""
    out, errs = [None] * n, []

    def run(r):
        try:
            out[r] = body(r)
        except BaseException as e:  # noqa: B902 - handed to the test's thread
            errs.append(e)

    ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    if errs:
        raise errs[0]
    assert not any(t.is_alive() for t in ts), "a rank never finished"
    return out


def rank_modules(client, name, world, **kw):
    return [RemoteLMHead(name, client=client, rank=r, world_size=world, **kw)
            for r in range(world)]


def shadow_gradient(client, module, batches, copy_w, copy_b, loss_scale=1.0, scaler_scale=1.0):
    """The sum the head's step holds: the same Computes (options, grad_scale, order) on the
    step's compute copy, into a fresh accumulator; returns (dW, db) fp32. batches: [(x, t)] in
    arrival order."""
    acc = unique("shadow")
    handle = client.put_weights(copy_w, copy_b)
    try:
        for x, t in batches:
            kw = _dx_dtype_opts(module, module.options(x.dtype), x.dtype)
            kw["grad_scale"] = loss_scale * scaler_scale * module.grad_scale
            client.compute(x, handle, t, accumulator=acc, want_dx=False, **kw)
        g = client.fetch_gradients(acc, reset=True)
    finally:
        client.drop_weights(handle)
        client.drop_accumulator(acc)
    return g.dw, g.db


def as_torch(arr):
    """A received array (ndarray, or BF16Array) as a torch tensor."""
    if isinstance(arr, lossd.BF16Array):
        return torch.from_numpy(arr.bits.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr))


def assert_matches_reference(exp, ref, cfg, step_count, what=""):
    """The export's master and optimizer state against torch's within the bound (ulps of each
    tensor's largest magnitude), and the compute copy bit-equal to the master's cast. Returns
    (the largest distance in ulps of the max, the largest elementwise in ulps)."""
    bound = ULPS_OF_MAX_PER_STEP * step_count
    pairs = [("master_w", exp.tensors["master_w"], ref.w.detach().numpy())]
    if ref.b is not None:
        pairs.append(("master_bias", exp.tensors["master_bias"], ref.b.detach().numpy()))
    names = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
             "max_exp_avg_sq": "max_exp_avg_sq"}
    if cfg.kind == "sgd":
        names = {"exp_avg": "momentum_buffer"} if cfg.momentum else {}
    for ours, theirs in names.items():
        if theirs == "max_exp_avg_sq" and not cfg.amsgrad:
            continue
        for suffix, p in (("_w", ref.w), ("_bias", ref.b)):
            if p is None or theirs not in ref.opt.state[p]:
                continue
            pairs.append((ours + suffix, exp.tensors[ours + suffix], ref.state(p, theirs)))
    worst, worst_plain = 0.0, 0
    for name, got, want in pairs:
        d = ulps_of_max(got, want)
        worst = max(worst, float(d.max()))
        worst_plain = max(worst_plain, int(ulps(got, want).max()))
        assert d.max() <= bound, "%s%s after %d steps: %d elements differ by more than %d " \
            "ulps of its largest value, max %.2f (at %s: %r vs torch's %r)" % (
                what, name, step_count, int((d > bound).sum()), bound, float(d.max()),
                np.unravel_index(int(d.argmax()), d.shape),
                float(np.asarray(got).reshape(-1)[d.argmax()]),
                float(np.asarray(want).reshape(-1)[d.argmax()]))
    cdt = TORCH_DTYPES[exp.compute_dtype]
    for m, c in (("master_w", "copy_w"), ("master_bias", "copy_bias")):
        if m in exp.tensors:
            cast = torch.from_numpy(np.array(exp.tensors[m])).to(cdt)
            got = as_torch(exp.tensors[c])
            assert torch.equal(got.view(-1).view(torch.int16 if cdt != torch.float32
                                                 else torch.int32),
                               cast.view(-1).view(torch.int16 if cdt != torch.float32
                                                  else torch.int32)), \
                "%s is not the %s cast of %s" % (c, exp.compute_dtype, m)
    return worst, worst_plain


def require_heads(client):
    if "hosted_head" not in client.server_info().features:
        pytest.skip("this lossd does not list the hosted_head feature")


class MadeHeads(list):
    """The names of the heads a test creates, dropped after it (made_heads)."""

    def name(self, prefix):
        """A fresh head name, dropped after the test."""
        name = unique(prefix)
        self.append(name)
        return name


def made_heads(client):
    """The body of a test module's `heads` fixture: skips without hosted heads, yields the
    MadeHeads a test names its heads with, and drops them after the test."""
    require_heads(client)
    made = MadeHeads()
    yield made
    for name in made:
        try:
            client.drop_head(name)
        except lossd.NotFoundError:
            pass
