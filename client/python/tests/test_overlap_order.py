# SPDX-License-Identifier: Apache-2.0
"""The client's checks of an overlapped Compute's reply order (preliminary summary, parts,
final summary), against an in-process fake server that gets the order wrong in each way. The
live-server tests cover the right order; these need no lossd binary."""

from concurrent import futures

import grpc
import numpy as np
import pytest

import lossd
from lossd import errors
from lossd._proto import pb, pb_grpc

BT, H, V = 3, 4, 5


def _summary(preliminary, dx_bytes):
    s = pb.ComputeSummary(preliminary=preliminary, backend="fake")
    if not preliminary:
        s.loss, s.tokens = 1.5, BT
    s.tensors.append(pb.TENSOR_DX)
    s.specs.append(pb.TensorSpec(dtype=pb.DTYPE_FP32, shape=[BT, H]))
    return pb.ComputeResponse(summary=s)


def _part(data, offset=0):
    return pb.ComputeResponse(part=pb.TensorPart(tensor=pb.TENSOR_DX, offset=offset, data=data))


class _Fake(pb_grpc.LossServicer):
    """Answers every Compute with the reply `mode` names, dX = x's bytes."""

    def __init__(self):
        self.mode = "good"

    def Compute(self, request_iterator, context):
        return iter(self._reply(request_iterator))

    def _reply(self, request_iterator):
        header, x = None, b""
        for r in request_iterator:
            if r.WhichOneof("kind") == "header":
                header = r.header
            elif r.part.tensor == pb.TENSOR_X:
                x += r.part.data
        assert header is not None and header.overlap
        m = self.mode
        if m == "no_final":
            return [_summary(True, x), _part(x)]
        if m == "part_after_final":
            return [_summary(True, x), _part(x[:8]), _summary(False, x), _part(x[8:], 8)]
        if m == "final_first":
            return [_summary(False, x), _part(x)]
        if m == "two_preliminary":
            return [_summary(True, x), _summary(True, x), _part(x), _summary(False, x)]
        if m == "other_outputs":
            final = _summary(False, x)
            final.summary.tensors[0] = pb.TENSOR_LSE
            return [_summary(True, x), _part(x), final]
        return [_summary(True, x), _part(x[:8]), _part(x[8:], 8), _summary(False, x)]


@pytest.fixture(scope="module")
def fake():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = _Fake()
    pb_grpc.add_LossServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, "127.0.0.1:%d" % port
    server.stop(None)


def _call(address):
    x = np.arange(BT * H, dtype=np.float32).reshape(BT, H)
    w = np.ones((V, H), dtype=np.float32)
    t = np.zeros(BT, dtype=np.int64)
    with lossd.Client(address, timeout=10) as c:
        return c.compute(x, w, t, want_dw=False), x


def test_the_right_order_is_accepted(fake):
    servicer, address = fake
    servicer.mode = "good"
    r, x = _call(address)
    assert r.loss == 1.5 and r.tokens == BT
    np.testing.assert_array_equal(r.dx, x)


@pytest.mark.parametrize("mode, message", [
    ("no_final", "no final summary"),
    ("part_after_final", "part after the final summary"),
    ("final_first", "a final summary where a preliminary one was due"),
    ("two_preliminary", "a preliminary summary where a final one was due"),
    ("other_outputs", "other outputs than the preliminary one"),
])
def test_a_wrong_order_is_a_protocol_error(fake, mode, message):
    servicer, address = fake
    servicer.mode = mode
    with pytest.raises(errors.ProtocolError) as e:
        _call(address)
    assert message in str(e.value)
