# SPDX-License-Identifier: Apache-2.0
"""Mixed precision through lossd.rl against a real lossd (CPU backend): bf16 or fp16 hidden
states with an fp32 head, and fp32 ones under torch.autocast(bfloat16). As Liger-Kernel's
chunked GRPO (W cast to the hidden dtype) and its JSD under autocast, the call computes in
the autocast dtype, else the hidden states', everything travels in it, and each gradient
comes back in its own tensor's dtype (dW of an fp32 head in fp32). Compared with the float64
torch reference over the same rounded operands, with conftest's tolerance table for the
compute dtype. Skipped without torch or the kinds."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

from lossd import rl  # noqa: E402
from lossd.nn import LossdRuntime  # noqa: E402
from conftest import SCALAR_RTOL, assert_close  # noqa: E402
from rl_torch_reference import (as64, jsd_loss, log_softmax, logprob_entropy,  # noqa: E402
                                policy_loss)

B, S, H, V, HT = 2, 5, 16, 40, 12
BF16 = torch.bfloat16
MODES = ["bf16_hidden", "fp16_hidden", "autocast"]
TABLE = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class Recording:
    """A Client that notes the dtype of every floating tensor it sends (X, the teacher's
    hidden states, W inline or uploaded), then sends it."""

    def __init__(self, client):
        self._client = client
        self.sent = set()

    def __getattr__(self, name):
        return getattr(self._client, name)

    def _note(self, *tensors):
        self.sent.update(t.dtype for t in tensors if torch.is_tensor(t))

    def compute(self, x, w, targets, **kw):
        self._note(x, w, kw.get("bias"), kw.get("teacher_x"), kw.get("teacher_w"))
        return self._client.compute(x, w, targets, **kw)

    def put_weights(self, w, bias=None, **kw):
        self._note(w, bias)
        return self._client.put_weights(w, bias, **kw)


@pytest.fixture
def runtime(client):
    features = set(client.server_info().features)
    missing = [k for k in ("logprob", "policy", "distill") if "loss_kind_" + k not in features]
    if missing:
        pytest.skip("the server does not compute loss kinds %s" % ", ".join(missing))
    rt = LossdRuntime(client=Recording(client))
    yield rt
    # Whatever the hidden states' or the heads' dtypes: everything travelled in one dtype,
    # the compute dtype (each test checks which).
    assert len(rt.client.sent) == 1, rt.client.sent
    rt.close()


def _leaf(shape, seed, dtype, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(True)


def _ref(t, cdt):
    """`t` as the server computes with it: rounded to `cdt`, as a float64 leaf (the cast's
    gradient is the identity, so its .grad is the reference for t's)."""
    return None if t is None else t.detach().to(cdt).double().requires_grad_(True)


def _mode(mode):
    """(the hidden states' dtype, the context the forward runs in, the compute dtype)."""
    if mode == "autocast":
        return torch.float32, torch.autocast("cpu", dtype=BF16), BF16
    dt = {"bf16_hidden": BF16, "fp16_hidden": torch.float16}[mode]
    return dt, contextlib.nullcontext(), dt


def _check_grads(pairs, cdt):
    """Each gradient in its own tensor's dtype, and close to the reference's (cdt's table)."""
    for name, t, r in pairs:
        assert t.grad is not None and t.grad.dtype == t.dtype, (name, t.grad, t.dtype)
        assert_close(name, t.grad.reshape(r.grad.shape), r.grad, TABLE[cdt])


def _check_scalar(name, got, want, cdt):
    assert got.dtype == torch.float32
    rtol = SCALAR_RTOL[TABLE[cdt]]
    assert abs(got.item() - want.item()) <= rtol * max(abs(want.item()), 1e-3), (
        name, got.item(), want.item())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("keep_ms", [0, 60_000])
def test_logprobs_and_entropy(runtime, mode, keep_ms):
    xdt, ctx, cdt = _mode(mode)
    x, w = _leaf((B * S, H), 1, xdt), _leaf((V, H), 2, torch.float32)
    ids = torch.randint(0, V, (B * S,), generator=torch.Generator().manual_seed(3))
    cl, ce = torch.randn(B * S, dtype=torch.float64), torch.randn(B * S, dtype=torch.float64)
    with ctx:
        logp, entropy = rl.fused_linear_for_ppo(x, w, ids, 0.9, runtime=runtime, keep_ms=keep_ms)
    assert logp.dtype == torch.float32 and entropy.dtype == xdt
    (logp.double() * cl + entropy.double() * ce).sum().backward()
    rx, rw = _ref(x, cdt), _ref(w, cdt)
    rlogp, rent = logprob_entropy(rx, rw, None, ids, 0.9)
    (rlogp * cl + rent * ce).sum().backward()
    assert_close("logp", logp, rlogp.detach(), TABLE[cdt])
    assert_close("entropy", entropy.float(), rent.detach(), TABLE[cdt])
    _check_grads([("dx", x, rx), ("dw", w, rw)], cdt)
    assert runtime.client.sent == {cdt}, runtime.client.sent


@pytest.mark.parametrize("mode", MODES)
def test_grpo(runtime, mode):
    xdt, ctx, cdt = _mode(mode)
    x3, w, b = _leaf((B, S, H), 11, xdt), _leaf((V, H), 12, torch.float32), _leaf((V,), 13,
                                                                                  torch.float32)
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S)
    mask[1, 3:] = 0
    adv = torch.randn(B, generator=g)
    ref = (-3.0 + 0.3 * torch.randn(B, S, generator=g))
    module = rl.LossdFusedLinearGRPOLoss(beta=0.1, runtime=runtime)
    with ctx:
        loss, (kl, _) = module(x3, w, ids, mask, adv, bias=b, ref_per_token_logps=ref)
    (2.0 * loss).backward()
    rx, rw, rb = _ref(x3.reshape(-1, H), cdt), _ref(w, cdt), _ref(b, cdt)
    rlogp, _ = logprob_entropy(rx, rw, rb, ids.reshape(-1), 1.0)
    opts = dict(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.1,
                max_completion_length=0, dapo_normalizer=0.0)
    rloss, rkl, _ = policy_loss(rlogp, as64(mask).reshape(-1), as64(adv).repeat_interleave(S),
                                None, as64(ref), opts, B)
    (2.0 * rloss).backward()
    _check_scalar("loss", loss, rloss, cdt)
    _check_scalar("kl", kl, rkl, cdt)
    _check_grads([("dx", x3, rx), ("dw", w, rw), ("db", b, rb)], cdt)
    assert runtime.client.sent == {cdt}, runtime.client.sent


@pytest.mark.parametrize("mode", MODES)
def test_jsd(runtime, mode):
    xdt, ctx, cdt = _mode(mode)
    x, w = _leaf((B * S, H), 21, xdt), _leaf((V, H), 22, torch.float32)
    # The teacher in fp32 both ways: its hidden states and head travel in the compute dtype.
    tx, tw = (_leaf(s, 23 + i, torch.float32).detach() for i, s in enumerate([(B * S, HT),
                                                                             (V, HT)]))
    module = rl.LossdFusedLinearJSD(jsd_beta=0.5, temperature=1.5, runtime=runtime)
    with ctx:
        loss = module(x, w, tx, tw, None)
    loss.backward()
    rx, rw = _ref(x, cdt), _ref(w, cdt)
    keep = torch.ones(B * S, dtype=torch.bool)
    rloss = jsd_loss(log_softmax(rx, rw, None, 1.5),
                     log_softmax(_ref(tx, cdt).detach(), _ref(tw, cdt).detach(), None, 1.5),
                     0.5, keep)
    rloss.backward()
    _check_scalar("loss", loss, rloss, cdt)
    _check_grads([("dx", x, rx), ("dw", w, rw)], cdt)
    assert runtime.client.sent == {cdt}, runtime.client.sent


def test_an_fp32_head_is_uploaded_once_in_the_compute_dtype(runtime):
    """With weight caching the head is cast and uploaded once while unchanged, not each call
    (a cast made anew each call would be a new tensor, a new upload)."""
    x, w = _leaf((B * S, H), 31, BF16), _leaf((V, H), 32, torch.float32)
    ids = torch.randint(0, V, (B * S,), generator=torch.Generator().manual_seed(33))
    handles = []
    for _ in range(3):
        rl.logprobs_from_hidden(x, w, ids, runtime=runtime).sum().backward()
        handles.append(runtime._handle)
    assert handles[0] is not None and all(h is handles[0] for h in handles)
    assert w.grad.dtype == torch.float32 and runtime.client.sent == {BF16}
