# SPDX-License-Identifier: Apache-2.0
"""Host tensors <-> wire bytes: dtype mapping, and bf16 for numpy, which has no bf16 type.

A bf16 tensor is held as its raw uint16 bit patterns in a BF16Array (or passed as a torch
bfloat16 tensor, or an ml_dtypes bfloat16 array). Conversions here are exact (widening) or
round to nearest even (narrowing), the same rule as the server's core/dtype.h. Never
imports torch: torch tensors are recognised by duck typing.
"""

import numpy as np

from lossd._proto import pb
from lossd.errors import InvalidArgumentError

DTYPE_NAMES = {
    pb.DTYPE_BF16: "bf16",
    pb.DTYPE_FP16: "fp16",
    pb.DTYPE_FP32: "fp32",
    pb.DTYPE_INT32: "int32",
    pb.DTYPE_INT64: "int64",
}
_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
_BY_NAME.update({"bfloat16": pb.DTYPE_BF16, "float16": pb.DTYPE_FP16, "half": pb.DTYPE_FP16,
                 "float32": pb.DTYPE_FP32, "float": pb.DTYPE_FP32})
_NUMPY = {
    pb.DTYPE_FP16: np.dtype("<f2"),
    pb.DTYPE_FP32: np.dtype("<f4"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_BF16: np.dtype("<u2"),  # bit patterns
}
FLOAT_DTYPES = (pb.DTYPE_BF16, pb.DTYPE_FP16, pb.DTYPE_FP32)
INT_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)


def dtype_size(dt):
    return _NUMPY[dt].itemsize


def numpy_dtype(dt):
    """The numpy dtype that holds wire dtype `dt` (uint16 bit patterns for bf16)."""
    return _NUMPY[dt]


def dtype_name(dt):
    return DTYPE_NAMES.get(dt, "unspecified(%d)" % dt)


def parse_dtype(value):
    """'bf16' / 'fp32' / np.float32 / torch.float32 / a pb.DType value -> pb.DType."""
    if value is None:
        return pb.DTYPE_UNSPECIFIED
    if isinstance(value, int):
        return value
    name = str(value).replace("torch.", "").lower()
    if name in _BY_NAME:
        return _BY_NAME[name]
    try:
        npd = np.dtype(value)
    except TypeError:
        npd = None
    if npd is not None:
        for k, v in _NUMPY.items():
            if k != pb.DTYPE_BF16 and v == npd.newbyteorder("<"):
                return k
    raise InvalidArgumentError("unknown dtype %r (use bf16, fp16, fp32, int32 or int64)" % (value,))


def float_to_bf16_bits(x):
    """float array -> uint16 bf16 bit patterns, round to nearest even, NaN kept a NaN."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32).astype(np.uint64)
    is_nan = np.isnan(f)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan_bits = ((bits >> 16) | 0x0040).astype(np.uint16)
    return np.where(is_nan, nan_bits, rounded).astype(np.uint16)


def bf16_bits_to_float(bits):
    """uint16 bf16 bit patterns -> float32 (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32)


class BF16Array:
    """A bf16 tensor as raw uint16 bit patterns. np.asarray(a) gives its float32 values."""

    __slots__ = ("bits",)

    def __init__(self, bits):
        bits = np.asarray(bits)
        if bits.dtype != np.uint16:
            raise InvalidArgumentError(
                "BF16Array holds uint16 bit patterns, got %s (use BF16Array.from_float to round "
                "floats)" % bits.dtype)
        self.bits = bits

    @classmethod
    def from_float(cls, x):
        return cls(float_to_bf16_bits(x))

    def to_float32(self):
        return bf16_bits_to_float(self.bits).reshape(self.bits.shape)

    def __array__(self, dtype=None, copy=None):
        out = self.to_float32()
        return out if dtype is None else out.astype(dtype)

    @property
    def shape(self):
        return self.bits.shape

    @property
    def ndim(self):
        return self.bits.ndim

    @property
    def size(self):
        return self.bits.size

    @property
    def nbytes(self):
        return self.bits.nbytes

    @property
    def dtype(self):
        return "bf16"

    def reshape(self, *shape):
        return BF16Array(self.bits.reshape(*shape))

    def __repr__(self):
        return "BF16Array(shape=%s, values=%r)" % (self.shape, self.to_float32())


def bf16(bits):
    """Tags a uint16 array of bf16 bit patterns as bf16."""
    return BF16Array(bits)


def _is_torch_tensor(v):
    return type(v).__module__.startswith("torch") and hasattr(v, "detach") and hasattr(v, "dtype")


def _torch_to_numpy(t):
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).replace("torch.", "")
    if name == "bfloat16":
        import torch

        return pb.DTYPE_BF16, t.view(torch.int16).numpy().view(np.uint16)
    return None, t.numpy()


def check_fits_int64(arr, name):
    """Refuses an unsigned 64-bit array holding a value above 2**63 - 1: cast to int64 it would
    wrap (2**64 - 100 becomes -100, an ignore_index, and its row would silently not count).
    InvalidArgumentError (a ValueError) naming `name`, the first such index and its value."""
    arr = np.asarray(arr)
    if arr.dtype.kind != "u" or arr.dtype.itemsize < 8 or arr.size == 0:
        return  # every narrower unsigned value fits
    over = np.flatnonzero(arr.reshape(-1) > np.uint64(np.iinfo(np.int64).max))
    if over.size:
        i = int(over[0])
        index = np.unravel_index(i, arr.shape) if arr.ndim > 1 else (i,)
        raise InvalidArgumentError(
            "%s[%s] = %d does not fit int64 (the wire's targets are int32 or int64; at most "
            "2**63 - 1): %d value(s) of %s are out of range" % (
                name, ", ".join(str(int(k)) for k in index), int(arr.reshape(-1)[i]),
                over.size, arr.dtype))


def to_wire(value, name, allowed):
    """Returns (pb dtype, shape tuple, C-contiguous little-endian ndarray) for one input tensor.

    `name` is the field name for error messages; `allowed` the pb dtypes this field takes.
    """
    dt = None
    if isinstance(value, BF16Array):
        dt, arr = pb.DTYPE_BF16, value.bits
    elif _is_torch_tensor(value):
        dt, arr = _torch_to_numpy(value)
    else:
        arr = np.asarray(value)
        if arr.dtype.name == "bfloat16":  # ml_dtypes
            dt, arr = pb.DTYPE_BF16, arr.view(np.uint16)
    if dt is None:
        if arr.dtype.kind in "iu" and set(allowed) <= set(INT_DTYPES) and arr.dtype not in (
                np.dtype("int32"), np.dtype("int64")):
            check_fits_int64(arr, name)
            arr = arr.astype(np.int64)  # any integer array (or list) works as targets
        if arr.dtype == np.uint16 and pb.DTYPE_BF16 in allowed:
            raise InvalidArgumentError(
                "%s is a uint16 array: tag bf16 bit patterns with lossd.bf16(array)" % name)
        for k, v in _NUMPY.items():
            if k != pb.DTYPE_BF16 and arr.dtype.newbyteorder("<") == v and arr.dtype.kind == v.kind:
                dt = k
                break
    if dt is None or dt not in allowed:
        raise InvalidArgumentError(
            "%s has dtype %s; lossd takes %s for it" % (
                name, dtype_name(dt) if dt is not None else arr.dtype,
                ", ".join(dtype_name(a) for a in allowed)))
    want = _NUMPY[dt]
    arr = np.ascontiguousarray(arr, dtype=want)
    return dt, tuple(int(s) for s in arr.shape), arr


def from_wire(dt, shape, buf):
    """Wraps received bytes (a bytearray or uint8 ndarray) as an ndarray (or BF16Array for
    bf16), no copy."""
    if dt not in _NUMPY:
        raise InvalidArgumentError("server sent a tensor of dtype %s" % dtype_name(dt))
    arr = np.frombuffer(buf, dtype=_NUMPY[dt]).reshape(shape)
    if dt == pb.DTYPE_BF16:
        return BF16Array(arr)
    return arr


def to_float64(value):
    """Any tensor this module accepts -> float64 ndarray (for references and tests)."""
    if isinstance(value, BF16Array):
        return value.to_float32().astype(np.float64)
    if _is_torch_tensor(value):
        return value.detach().cpu().double().numpy()
    return np.asarray(value, dtype=np.float64)
