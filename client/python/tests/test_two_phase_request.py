# SPDX-License-Identifier: Apache-2.0
"""compute()'s two-phase log-prob requests (keep_ms, ticket) against an in-process fake server
that records what arrives: the forward's keep_ms, a backward's header (the ticket, no X, W,
bias or targets, the options the ticket holds left unset) and tensors (dlogp and dentropy
alone), the ticket and its expiry read from the reply, List's ticket entries, the feature
check, and every refusal made before anything is sent. test_two_phase_server.py runs the
same calls through a real lossd."""

from concurrent import futures

import grpc
import numpy as np
import pytest

import lossd
from lossd._proto import pb, pb_grpc

BT, H, V = 5, 4, 7
RNG = np.random.default_rng(25)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


class _Fake(pb_grpc.LossServicer):
    """Records each Compute's header and tensor ids; answers a forward that keeps with a
    ticket, a backward with dX (filled with `dx_value`), and List with one ticket entry."""

    def __init__(self):
        self.features = ["loss_kind_logprob", "logprob_two_phase", "list_state"]
        self.headers, self.tensors = [], []
        self.dx_value = 0.25

    def ServerInfo(self, request, context):
        return pb.ServerInfoResponse(version="fake", instance="fake-1", features=self.features)

    def List(self, request, context):
        return pb.ListResponse(entries=[pb.StateEntry(kind=pb.STATE_TICKET, name="tk-7",
                                                      bytes=640, last_used_unix_ms=12)])

    def Compute(self, request_iterator, context):
        header, ids = None, []
        for r in request_iterator:
            if r.WhichOneof("kind") == "header":
                header = r.header
            elif r.part.tensor not in ids:
                ids.append(r.part.tensor)
        self.headers.append(header)
        self.tensors.append(ids)
        s = pb.ComputeSummary(backend="fake", instance="fake-1", tokens=BT)
        if header.keep_ms:
            s.ticket, s.ticket_expires_unix_ms = "tk-7", 1234567
            logp = np.full(BT, -1.5, np.float32)
            s.tensors.append(pb.TENSOR_LOGP)
            s.specs.append(pb.TensorSpec(dtype=pb.DTYPE_FP32, shape=[BT]))
            return iter([pb.ComputeResponse(summary=s), pb.ComputeResponse(part=pb.TensorPart(
                tensor=pb.TENSOR_LOGP, offset=0, data=logp.tobytes()))])
        dx = np.full((BT, H), self.dx_value, np.float32)
        s.tensors.append(pb.TENSOR_DX)
        s.specs.append(pb.TensorSpec(dtype=pb.DTYPE_FP32, shape=[BT, H]))
        return iter([pb.ComputeResponse(summary=s), pb.ComputeResponse(part=pb.TensorPart(
            tensor=pb.TENSOR_DX, offset=0, data=dx.tobytes()))])


@pytest.fixture()
def fake():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = _Fake()
    pb_grpc.add_LossServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with lossd.Client("127.0.0.1:%d" % port, timeout=10) as c:  # overlap on, the default
        yield servicer, c
    server.stop(None)


def forward(c, **kw):
    args = dict(kind="logprob", keep_ms=1500, temperature=0.8, want_dx=False, want_dw=False,
                want_db=False)
    args.update(kw)
    return c.compute(rand(BT, H), rand(V, H), RNG.integers(0, V, BT), **args)


def test_forward_sends_keep_ms_and_reads_the_ticket(fake):
    servicer, c = fake
    r = forward(c)
    h = servicer.headers[-1]
    assert h.keep_ms == 1500 and not h.ticket and h.kind == pb.LOSS_KIND_LOGPROB
    assert not h.overlap, "a two-phase call is never overlapped"
    assert h.options.temperature == pytest.approx(0.8)
    assert (r.ticket, r.ticket_expires_unix_ms) == ("tk-7", 1234567)
    np.testing.assert_array_equal(r.logp, np.full(BT, -1.5, np.float32))
    # A call without keep_ms sends 0 (no ticket) and reads none.
    r = c.compute(rand(BT, H), rand(V, H), RNG.integers(0, V, BT), kind="logprob",
                  dlogp=rand(BT), overlap=False)
    assert servicer.headers[-1].keep_ms == 0 and r.ticket == "" and r.ticket_expires_unix_ms == 0


def test_backward_sends_the_ticket_and_upstream_gradients_only(fake):
    servicer, c = fake
    dlogp, dent = rand(BT), rand(BT)
    r = c.compute(None, None, None, kind="logprob", ticket="tk-7", dlogp=dlogp, dentropy=dent,
                  want_dw=False, grad_dtype="fp32", grad_scale=0.5, accumulator="acc-a")
    h = servicer.headers[-1]
    assert h.ticket == "tk-7" and h.keep_ms == 0 and h.kind == pb.LOSS_KIND_LOGPROB
    assert not h.overlap
    for field in ("x", "w", "bias", "targets", "class_weights", "grad_output", "teacher_x"):
        assert not h.HasField(field), field
    assert not h.weight_handle and not h.head
    assert servicer.tensors[-1] == [pb.TENSOR_DLOGP, pb.TENSOR_DENTROPY]
    assert list(h.dlogp.shape) == [BT] and list(h.dentropy.shape) == [BT]
    # The ticket holds the temperature and ignore_index: left unset, for the server to fill.
    assert not h.options.HasField("temperature") and not h.options.HasField("ignore_index")
    assert h.options.softcap == 0 and h.options.chunk_rows == 0
    assert h.options.grad_dtype == pb.DTYPE_FP32 and h.options.grad_scale == 0.5
    assert h.accumulator == "acc-a" and h.outputs.dx and not h.outputs.dw
    np.testing.assert_array_equal(r.dx, np.full((BT, H), 0.25, np.float32))
    # Values the caller gives are sent (the server refuses one other than the ticket's).
    c.compute(None, None, None, kind="logprob", ticket="tk-7", dlogp=dlogp, temperature=0.8,
              ignore_index=3, softcap=30.0)
    o = servicer.headers[-1].options
    assert o.temperature == pytest.approx(0.8) and o.ignore_index == 3 and o.softcap == 30.0
    assert servicer.tensors[-1] == [pb.TENSOR_DLOGP]


def test_backward_of_a_head_ticket_sends_its_key(fake):
    servicer, c = fake
    c.compute(None, None, None, kind="logprob", ticket="tk-7", dentropy=rand(BT), rank=2,
              micro_batch=5, head_version=9)
    h = servicer.headers[-1]
    assert (h.rank, h.micro_batch, h.head_version) == (2, 5, 9) and not h.head
    with pytest.raises(lossd.InvalidArgumentError, match="rank 1 without micro_batch"):
        c.compute(None, None, None, kind="logprob", ticket="tk-7", dlogp=rand(BT), rank=1)
    with pytest.raises(lossd.InvalidArgumentError, match="rank and micro_batch must be >= 0"):
        c.compute(None, None, None, kind="logprob", ticket="tk-7", dlogp=rand(BT),
                  micro_batch=-1)


@pytest.mark.parametrize("given, message", [
    (lambda: dict(x=rand(BT, H)), "ticket given with x:"),
    (lambda: dict(w=rand(V, H)), "ticket given with w:"),
    (lambda: dict(targets=RNG.integers(0, V, BT)), "ticket given with targets:"),
    (lambda: dict(bias=rand(V)), "ticket given with bias:"),
    (lambda: dict(head="lm"), "ticket given with head:"),
    (lambda: dict(advantages=rand(BT), teacher_x=rand(BT, H)),
     "ticket given with advantages, teacher_x:"),
    (lambda: dict(kind="cross_entropy"), "of kind 'logprob' .*got kind 'cross_entropy'"),
    (lambda: dict(keep_ms=10), "keep_ms 10 with a ticket"),
    (lambda: dict(ticket=""), "ticket must be a non-empty string"),
    (lambda: dict(ticket=7), "ticket must be a non-empty string"),
    (lambda: dict(out={"dx": np.zeros((BT, H), np.float32)}),
     "out: a ticket's backward cannot check caller buffers"),
    (lambda: dict(grad_dtype="bf16"), "grad_dtype must be the input dtype \\(None: a ticket's"),
])
def test_backward_refusals_before_sending(fake, given, message):
    servicer, c = fake
    args = dict(x=None, w=None, targets=None, kind="logprob", ticket="tk-7", dlogp=rand(BT))
    args.update(given())
    x, w, t = args.pop("x"), args.pop("w"), args.pop("targets")
    with pytest.raises(lossd.InvalidArgumentError, match=message):
        c.compute(x, w, t, **args)
    assert servicer.headers == []


@pytest.mark.parametrize("keep_ms", [-1, 1 << 32, 2.5, "60000", True])
def test_keep_ms_must_be_a_uint32(fake, keep_ms):
    servicer, c = fake
    with pytest.raises(lossd.InvalidArgumentError, match="keep_ms must be a whole number of "
                       "milliseconds in \\[0, 4294967295\\].*got %s" % repr(keep_ms)[:4]):
        forward(c, keep_ms=keep_ms)
    assert servicer.headers == []
    forward(c, keep_ms=np.uint32((1 << 32) - 1))  # the largest, and numpy's integers, go
    assert servicer.headers[-1].keep_ms == (1 << 32) - 1


def test_a_server_without_the_feature_is_refused_before_sending(fake):
    servicer, c = fake
    servicer.features = ["loss_kind_logprob"]
    with pytest.raises(lossd.UnimplementedError, match="'logprob_two_phase'"):
        forward(c)
    with pytest.raises(lossd.UnimplementedError, match="'logprob_two_phase'"):
        c.compute(None, None, None, kind="logprob", ticket="tk-7", dlogp=rand(BT))
    assert servicer.headers == []
    # A one-phase logprob call needs no such feature.
    c.compute(rand(BT, H), rand(V, H), RNG.integers(0, V, BT), kind="logprob", dlogp=rand(BT),
              overlap=False)
    assert len(servicer.headers) == 1


def test_list_state_names_ticket_entries(fake):
    _, c = fake
    entries = c.list_state()
    assert [(e.kind, e.name, e.bytes, e.last_used_unix_ms) for e in entries] == [
        ("ticket", "tk-7", 640, 12)]
