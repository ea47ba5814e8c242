# SPDX-License-Identifier: Apache-2.0
"""Mixed precision through lossd.nn against a real lossd (CPU backend).

LossdFusedLinearCrossEntropyLoss: bf16 hidden states with an fp32 head (and bias), and fp32
ones under torch.autocast(bfloat16) (where Liger's FLCE computes in the autocast dtype): the
call computes in bf16, W and the bias travel cast to it (uploaded once while unchanged), and
each gradient comes back in its own tensor's dtype. RemoteLMHead: hidden states are cast to
the head's compute dtype under autocast, or where the cast is exact (bf16 into an fp32
head); a narrowing cast outside autocast is refused. Against the float64 torch reference over
the same rounded operands, with conftest's tolerance table."""

import contextlib

import pytest

torch = pytest.importorskip("torch")

import lossd  # noqa: E402
from lossd.nn import LossdFusedLinearCrossEntropyLoss, RemoteLMHead  # noqa: E402
from conftest import SCALAR_RTOL, assert_close  # noqa: E402
from head_harness import make_batch, make_head, made_heads  # noqa: E402
from torch_reference import torch_reference  # noqa: E402

BF16 = torch.bfloat16
BT, H, V = 19, 24, 67  # nothing a multiple of 8


class Recording:
    """A Client that notes the dtype of every floating tensor it sends, then sends it."""

    def __init__(self, client):
        self._client = client
        self.sent = set()

    def __getattr__(self, name):
        return getattr(self._client, name)

    def _note(self, *tensors):
        self.sent.update(t.dtype for t in tensors if torch.is_tensor(t))

    def compute(self, x, w, targets, **kw):
        self._note(x, w, kw.get("bias"))
        return self._client.compute(x, w, targets, **kw)

    def put_weights(self, w, bias=None, **kw):
        self._note(w, bias)
        return self._client.put_weights(w, bias, **kw)


def _mode(mode):
    if mode == "autocast":
        return torch.float32, torch.autocast("cpu", dtype=BF16)
    return BF16, contextlib.nullcontext()


def _leaf(shape, seed, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(True)


@pytest.mark.parametrize("mode", ["bf16_hidden", "autocast"])
@pytest.mark.parametrize("reduction,cache", [("mean", True), ("none", True), ("mean", False)])
def test_flce_computes_in_bf16_and_returns_each_gradient_in_its_dtype(client, mode, reduction,
                                                                       cache):
    xdt, ctx = _mode(mode)
    x = _leaf((BT, H), 1, xdt)
    w, b = _leaf((V, H), 2, torch.float32, 0.4), _leaf((V,), 3, torch.float32, 0.5)
    t = torch.randint(0, V, (BT,), generator=torch.Generator().manual_seed(4))
    t[5] = -100
    rec = Recording(client)
    module = LossdFusedLinearCrossEntropyLoss(reduction=reduction, client=rec, cache_weights=cache)
    up = torch.randn(BT, generator=torch.Generator().manual_seed(5)) if reduction == "none" \
        else torch.tensor(0.7)
    losses = []
    for _ in range(2):  # twice: the cast head is uploaded once (cache) and gradients add up
        with ctx:
            loss = module(w, x, t, b)
        loss.backward(up)
        losses.append(loss)
    assert rec.sent == {BF16}, rec.sent
    ref = torch_reference(x.detach().to(BF16), w.detach().to(BF16), t, b.detach().to(BF16),
                          reduction=reduction, upstream=up)
    assert losses[0].dtype == torch.float32
    assert_close("loss", losses[0], ref["loss"], "bf16")
    for name, p, want in (("dx", x, ref["dx"]), ("dw", w, ref["dw"]), ("db", b, ref["db"])):
        assert p.grad.dtype == p.dtype, (name, p.grad.dtype, p.dtype)
        assert_close(name, p.grad, 2 * want, "bf16")
    module.release()


@pytest.fixture
def heads(client):
    yield from made_heads(client)


def test_remote_head_takes_bf16_hidden_into_an_fp32_head(client, heads):
    """The exact upcast: the head computes in fp32 on the bf16 values; dX comes back bf16."""
    w, b = make_head(40)
    mod = RemoteLMHead(heads.name("up"), w, b, client=client)
    x, t = make_batch(4000, "bf16")
    xg = x.clone().requires_grad_()
    loss = mod(xg, t)
    loss.backward()
    ref = torch_reference(x, w, t, b)
    assert abs(loss.item() - ref["loss"].item()) <= SCALAR_RTOL["fp32"] * abs(ref["loss"].item())
    assert xg.grad.dtype == BF16
    assert_close("dx", xg.grad, ref["dx"], "bf16")


def test_remote_head_under_autocast_casts_to_its_compute_dtype(client, heads):
    """fp32 hidden states under bf16 autocast into a head computing in bf16: cast; dX fp32.
    Outside autocast the same call is refused, naming both dtypes."""
    w, b = make_head(41)
    mod = RemoteLMHead(heads.name("amp"), w, b, client=client, compute_dtype="bf16")
    x, t = make_batch(4100, "fp32")
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=BF16):
        loss = mod(xg, t)
    loss.backward()
    ref = torch_reference(x.to(BF16), w.to(BF16), t, b.to(BF16))
    assert abs(loss.item() - ref["loss"].item()) <= SCALAR_RTOL["bf16"] * abs(ref["loss"].item())
    assert xg.grad.dtype == torch.float32
    assert_close("dx", xg.grad, ref["dx"], "bf16")
    with pytest.raises(lossd.InvalidArgumentError,
                       match="hidden is float32 but head .* computes in bf16: a narrowing cast "
                             "outside torch.autocast is refused"):
        mod(x, t)
