# SPDX-License-Identifier: Apache-2.0
"""Compute's tensor parts as protobuf wire bytes, written and read by hand: the request parts
are encoded straight from the tensor's memory (one copy, no TensorPart message), and a reply
part's data is a memoryview into the bytes gRPC received (no copy) until the Assembler puts it
in place. Every other message (the header, summaries, anything unusual) goes through protobuf.

Why: with protobuf messages a 4 MiB part was copied four times on the way out (tobytes, the
TensorPart, the ComputeRequest, its serialization) and three times on the way in (parse, the
`data` field, the Assembler), every copy holding the GIL and touching fresh pages (bench/
RESULTS.md, "The Python client's per-call cost"). The bytes are the same as protobuf's.
"""

import numpy as np

from lossd._proto import pb

COMPUTE_METHOD = "/lossd.v1.Loss/Compute"

# Wire tags: (field number << 3) | wire type; 0 = varint, 2 = length-delimited.
_TAG_PART = (2 << 3) | 2  # ComputeRequest.part and ComputeResponse.part
_TAG_TENSOR = (1 << 3) | 0  # TensorPart.tensor
_TAG_OFFSET = (2 << 3) | 0  # TensorPart.offset
_TAG_DATA = (3 << 3) | 2  # TensorPart.data


def _varint(n):
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_part(tensor_id, offset, data):
    """The serialized ComputeRequest{part: TensorPart{tensor_id, offset, data}}: the bytes
    protobuf writes (zero fields left out), with `data` (a byte memoryview) copied once."""
    inner = b""
    if tensor_id:
        inner += bytes((_TAG_TENSOR,)) + _varint(tensor_id)
    if offset:
        inner += bytes((_TAG_OFFSET,)) + _varint(offset)
    n = len(data)
    if n:
        inner += bytes((_TAG_DATA,)) + _varint(n)
    head = bytes((_TAG_PART,)) + _varint(len(inner) + n) + inner
    return b"".join((head, data))


def encoded_parts(tensor_id, arr, part_bytes):
    """encode_part for each part of one tensor, split as lossd._transfer.parts splits it
    (at most part_bytes rounded down to whole elements, at least one, in byte order)."""
    mv = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    elem = arr.itemsize
    step = max(elem, part_bytes - part_bytes % elem)
    for off in range(0, len(mv), step):
        yield encode_part(tensor_id, off, mv[off:off + step])


class WirePart:
    """A reply's TensorPart read by hand: tensor, offset, and data as a memoryview into the
    received message (valid while this object lives)."""

    __slots__ = ("tensor", "offset", "data")

    def __init__(self, tensor, offset, data):
        self.tensor, self.offset, self.data = tensor, offset, data


class PartResponse:
    """A ComputeResponse holding one part, as far as its readers look at one."""

    __slots__ = ("part",)

    def __init__(self, part):
        self.part = part

    @staticmethod
    def WhichOneof(name):  # noqa: N802 - protobuf's name
        return "part" if name == "kind" else None


def _read_varint(b, pos, end):
    """(value, next position), or None past `end` or beyond 10 bytes."""
    n, shift = 0, 0
    while pos < end and shift < 70:
        c = b[pos]
        pos += 1
        n |= (c & 0x7F) << shift
        if c < 0x80:
            return n, pos
        shift += 7
    return None


def _read_part(b):
    """WirePart of a message that is exactly one ComputeResponse.part whose fields each come
    at most once, in field order, as protobuf writes them; None for anything else."""
    if len(b) < 2 or b[0] != _TAG_PART:
        return None
    got = _read_varint(b, 1, len(b))
    if got is None or got[1] + got[0] != len(b):
        return None
    pos, end = got[1], len(b)
    fields = {}
    last = 0
    while pos < end:
        tag = b[pos]
        pos += 1
        if tag not in (_TAG_TENSOR, _TAG_OFFSET, _TAG_DATA) or tag <= last:
            return None
        last = tag
        got = _read_varint(b, pos, end)
        if got is None:
            return None
        value, pos = got
        if tag == _TAG_DATA:
            if pos + value > end:
                return None
            fields[tag] = (pos, value)
            pos += value
        else:
            fields[tag] = value
    tensor = fields.get(_TAG_TENSOR, 0)
    if tensor >= 1 << 31:  # a negative enum value (ten bytes): left to protobuf
        return None
    begin, n = fields.get(_TAG_DATA, (0, 0))
    return WirePart(tensor, fields.get(_TAG_OFFSET, 0) & ((1 << 64) - 1),
                    memoryview(b)[begin:begin + n])


def parse_response(b):
    """A Compute reply message: a PartResponse for a plain part, else the parsed
    pb.ComputeResponse (protobuf's own errors for malformed bytes)."""
    part = _read_part(b)
    if part is not None:
        return PartResponse(part)
    return pb.ComputeResponse.FromString(b)


def compute_call(channel):
    """Compute on `channel` taking requests as bytes (encoded here or serialized by the
    caller) and answering with parse_response's messages."""
    return channel.stream_stream(COMPUTE_METHOD, request_serializer=None,
                                 response_deserializer=parse_response)
