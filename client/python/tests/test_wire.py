# SPDX-License-Identifier: Apache-2.0
"""lossd._wire against protobuf itself: the hand-encoded request parts are protobuf's bytes,
a hand-read reply part holds what protobuf reads, and anything unusual goes to protobuf."""

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from lossd._proto import pb
from lossd._transfer import parts
from lossd._wire import PartResponse, encode_part, encoded_parts, parse_response

# Sizes and values around the varint boundaries (one byte holds 0..127).
SIZES = (0, 1, 7, 127, 128, 300, 16385)
TENSORS = (0, 1, 5, 127, 128, 200)
OFFSETS = (0, 1, 127, 128, 1 << 40, (1 << 64) - 1)


def test_encode_part_is_protobufs_bytes_and_reads_back():
    rng = np.random.default_rng(3)
    for n in SIZES:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        for tid in TENSORS:
            for off in OFFSETS:
                want = pb.ComputeRequest(part=pb.TensorPart(
                    tensor=tid, offset=off, data=data)).SerializeToString()
                got = encode_part(tid, off, memoryview(data))
                assert got == want, (n, tid, off)
                msg = parse_response(got)
                ref = pb.ComputeResponse.FromString(got).part
                assert isinstance(msg, PartResponse) and msg.WhichOneof("kind") == "part"
                assert (msg.part.tensor, msg.part.offset, bytes(msg.part.data)) == (
                    ref.tensor, ref.offset, ref.data), (n, tid, off)


def test_encoded_parts_split_as_parts_does():
    for arr, part_bytes in ((np.arange(10, dtype=np.float32), 7),
                            (np.arange(10, dtype=np.int64), 7),
                            (np.arange(9, dtype=np.uint16), 7),
                            (np.arange(3000, dtype=np.float32).reshape(30, 100), 4 << 10),
                            (np.zeros((0, 4), np.float32), 16)):
        want = [pb.ComputeRequest(part=p).SerializeToString()
                for p in parts(pb.TENSOR_X, arr, part_bytes)]
        assert list(encoded_parts(pb.TENSOR_X, arr, part_bytes)) == want, (arr.dtype, arr.shape)


@pytest.mark.parametrize("msg", [
    pb.ComputeResponse(summary=pb.ComputeSummary(loss=1.5, tensors=[pb.TENSOR_DX])),
    pb.ComputeResponse(part=pb.TensorPart(tensor=-1, offset=3, data=b"ab")),  # ten-byte enum
    pb.ComputeResponse(),
], ids=["summary", "negative_tensor", "empty"])
def test_other_messages_go_to_protobuf(msg):
    got = parse_response(msg.SerializeToString())
    assert isinstance(got, pb.ComputeResponse)
    assert got == msg


def test_unusual_layouts_read_as_protobuf_reads_them():
    # Fields out of order, a field twice (the last wins), an unknown field: protobuf's reading.
    inner = b"\x10\x05\x08\x02" + b"\x1a\x02ab" + b"\x1a\x01c" + b"\x20\x07"
    raw = b"\x12" + bytes((len(inner),)) + inner
    got = parse_response(raw)
    assert isinstance(got, pb.ComputeResponse)
    assert (got.part.tensor, got.part.offset, got.part.data) == (2, 5, b"c")


def test_malformed_bytes_raise_protobufs_error():
    for raw in (b"\x12\x05\x08", b"\x12\x03\x1a\x09ab", b"\x12"):
        with pytest.raises(DecodeError):
            parse_response(raw)
