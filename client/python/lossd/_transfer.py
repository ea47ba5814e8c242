# SPDX-License-Identifier: Apache-2.0
"""The lossd client's transfer machinery: outgoing TensorPart messages, striping over several
streams at once, and receivers that put reply parts in place while checking the wire contract
(order, offsets, sizes). Knows lossd's messages, never opens a call of its own.
"""

import threading
import time

import grpc
import numpy as np

from lossd import errors
from lossd._proto import pb
from lossd.tensors import FLOAT_DTYPES, INT_DTYPES, BF16Array, dtype_name, from_wire

def parts(tensor_id, arr, part_bytes, begin=0, end=None):
    """Yields TensorPart messages for one tensor's bytes [begin, end) (default: all), in byte
    order, each at most part_bytes rounded down to whole elements (at least one): servers may
    refuse a part that splits an element. Offsets are offsets into the tensor."""
    # Flat bytes first: memoryview.cast refuses a zero-size array of more than one dimension,
    # which must reach the server (and its error naming the shape) like any other.
    mv = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    n = len(mv) if end is None else end
    elem = arr.itemsize
    step = max(elem, part_bytes - part_bytes % elem)
    off = begin
    while off < n:
        stop = min(n, off + step)
        yield pb.TensorPart(tensor=tensor_id, offset=off, data=mv[off:stop].tobytes())
        off = stop


# At most this many ranges for one fetch that must fit a server's memory budget.
MAX_FETCH_RANGES = 1 << 16


def fetch_ranges_within(total_bytes, budget_bytes, at_least):
    """How many ranges of whole fp32 values a fetch of `total_bytes` takes so that each holds
    at most half of a server's memory budget of `budget_bytes`, and at least `at_least`.

    Half, because a range of the whole budget would wait until the server held no other
    memory at all, and hold every compute off while it lasted. 0 where ranges cannot help:
    `at_least` ranges already fit the budget (so the fetch was refused for something else),
    the budget is smaller than two values, or it would take more than MAX_FETCH_RANGES.
    """
    values = total_bytes // 4
    at_least = max(at_least, 1)
    if -(-values // at_least) * 4 <= budget_bytes:
        return 0
    per_range = budget_bytes // 2 // 4
    if per_range == 0:
        return 0
    ranges = max(at_least, -(-values // per_range))
    return 0 if ranges > MAX_FETCH_RANGES else ranges


class StripeGroup:
    """Runs the stripes of one striped call at once, a thread each, and gathers the outcome.

    Once a stripe has failed the others are pointless, and a stripe the server never heard of
    would leave its siblings waiting there until their deadline, so the group cancels the
    calls still running: at once after any error but ABORTED, and a grace period after an
    ABORTED (the server aborted the whole upload and tells every stripe; the grace lets the
    stripe that caused it report why). Raises the first error (in the order they happened)
    that is neither ABORTED nor the group's own cancelling, else the first error.
    """

    def __init__(self, n, aborted_grace):
        self._n = n
        self._grace = aborted_grace
        self._cv = threading.Condition()
        self._calls = [None] * n
        self._errors = [None] * n
        self._cancelled = [False] * n
        self._failed = []
        self._finished = 0
        self._cancel_at = float("inf")
        self._cancel_all = False

    def register(self, i, call):
        """Stripe i's call (anything with cancel()) is live; one registered after the group
        gave up is cancelled at once."""
        with self._cv:
            self._calls[i] = call
            if self._cancel_all:
                self._cancelled[i] = True
                call.cancel()

    def run(self, body):
        threads = [threading.Thread(target=self._stripe, args=(body, i), daemon=True,
                                    name="lossd-stripe-%d" % i) for i in range(self._n)]
        for t in threads:
            t.start()
        with self._cv:
            while self._finished < self._n:
                now = time.monotonic()
                if now >= self._cancel_at and not self._cancel_all:
                    self._cancel_all = True
                    for i, call in enumerate(self._calls):
                        if call is not None:
                            self._cancelled[i] = True
                            call.cancel()
                wait = None if self._cancel_at == float("inf") else max(0.0, self._cancel_at - now)
                if self._cancel_all:
                    wait = None
                self._cv.wait(wait)
        for t in threads:
            t.join()
        live = [i for i in self._failed if not self._cancelled[i]]
        for i in live:
            if getattr(self._errors[i], "code", None) != grpc.StatusCode.ABORTED:
                raise self._errors[i]
        if live:
            raise self._errors[live[0]]
        if self._failed:
            raise self._errors[self._failed[0]]

    def _stripe(self, body, i):
        err = None
        try:
            body(i)
        except BaseException as e:  # noqa: B902 - handed to the caller's thread by run()
            err = e
        with self._cv:
            self._finished += 1
            self._calls[i] = None
            if err is not None:
                self._failed.append(i)
                self._errors[i] = err
                aborted = getattr(err, "code", None) == grpc.StatusCode.ABORTED
                self._cancel_at = min(self._cancel_at,
                                      time.monotonic() + (self._grace if aborted else 0.0))
            self._cv.notify_all()


def check_gradients_header(header, method="FetchGradients"):
    """Returns (dw shape, db shape or None, dw bytes, db bytes) of a checked GradientsHeader."""
    dw = tuple(int(s) for s in header.dw.shape)
    if header.dw.dtype != pb.DTYPE_FP32 or len(dw) != 2 or min(dw) < 0:
        raise errors.ProtocolError("dw announced as %s %s, expected fp32 (V, H)" % (
            dtype_name(header.dw.dtype), dw), method=method)
    db = None
    if header.HasField("db") and len(header.db.shape) > 0:
        db = tuple(int(s) for s in header.db.shape)
        if header.db.dtype != pb.DTYPE_FP32 or db != (dw[0],):
            raise errors.ProtocolError("db announced as %s %s, expected fp32 (%d,)" % (
                dtype_name(header.db.dtype), db, dw[0]), method=method)
    return dw, db, 4 * dw[0] * dw[1], 4 * dw[0] if db is not None else 0


class RangeReceiver:
    """Receives one ranged FetchGradients stream (bytes [begin, end) of dW | db) straight into
    place, checking that parts come in byte order, stay in the range and within their tensor,
    and cover it exactly. dw/db: writable byte memoryviews, or None to check and drop."""

    def __init__(self, begin, end, dw_bytes, dw=None, db=None):
        self.begin, self.end, self.next = begin, end, begin
        self.dw_bytes = dw_bytes
        self.dw, self.db = dw, db

    def add(self, part, db_bytes):
        is_db = part.tensor == pb.TENSOR_DB
        if part.tensor != pb.TENSOR_DW and not (is_db and db_bytes > 0):
            raise errors.ProtocolError("part for unannounced tensor %d" % part.tensor,
                                       method="FetchGradients")
        limit = db_bytes if is_db else self.dw_bytes
        n = len(part.data)
        if part.offset + n > limit:
            raise errors.ProtocolError("tensor %d: part [%d, %d) runs past its %d bytes" % (
                part.tensor, part.offset, part.offset + n, limit), method="FetchGradients")
        at = part.offset + (self.dw_bytes if is_db else 0)
        if at != self.next:
            raise errors.ProtocolError("part at byte %d of dw|db, expected %d" % (at, self.next),
                                       method="FetchGradients")
        if at + n > self.end:
            raise errors.ProtocolError("part [%d, %d) runs past the range's end %d" % (
                at, at + n, self.end), method="FetchGradients")
        dst = self.db if is_db else self.dw
        if dst is not None:
            dst[part.offset:part.offset + n] = part.data
        self.next += n

    def finish(self):
        if self.next != self.end:
            raise errors.ProtocolError("range [%d, %d) ended at %d" % (
                self.begin, self.end, self.next), method="FetchGradients")


class Assembler:
    """Reassembles tensors from reply parts, checking the wire contract as it goes."""

    def __init__(self, method, into=None):
        self.method = method
        self.into = into or {}  # tensor id -> caller ndarray to receive into
        self.received = 0
        self.specs = {}
        self.order = []
        self.bufs = {}
        self.filled = {}

    def expect(self, tensor_id, spec):
        if tensor_id in self.specs:
            raise errors.ProtocolError("tensor %d announced twice" % tensor_id, method=self.method)
        shape = tuple(int(s) for s in spec.shape)
        if any(s < 0 for s in shape) or spec.dtype not in FLOAT_DTYPES + INT_DTYPES:
            raise errors.ProtocolError("bad spec for tensor %d: %s %s" % (
                tensor_id, dtype_name(spec.dtype), shape), method=self.method)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(
            {pb.DTYPE_BF16: "u2", pb.DTYPE_FP16: "f2", pb.DTYPE_FP32: "f4",
             pb.DTYPE_INT32: "i4", pb.DTYPE_INT64: "i8"}[spec.dtype]).itemsize
        self.specs[tensor_id] = (spec.dtype, shape)
        self.order.append(tensor_id)
        target = self.into.get(tensor_id)
        if target is not None:
            mv = memoryview(target)
            if mv.readonly or not mv.c_contiguous or mv.nbytes != nbytes:
                raise errors.InvalidArgumentError(
                    "output buffer for tensor %d: needs %d writable C-contiguous bytes, has %d%s"
                    % (tensor_id, nbytes, mv.nbytes, " (read-only)" if mv.readonly else ""),
                    method=self.method)
            self.bufs[tensor_id] = np.asarray(mv.cast("B"))
        else:
            # Not zero-filled (a bytearray would be, holding the GIL): every byte is written
            # before finish() hands it out.
            self.bufs[tensor_id] = np.empty(nbytes, np.uint8)
        self.filled[tensor_id] = 0

    def add(self, part):
        t = part.tensor
        if t not in self.bufs:
            raise errors.ProtocolError("part for unannounced tensor %d" % t, method=self.method)
        buf, got = self.bufs[t], self.filled[t]
        if part.offset != got:
            raise errors.ProtocolError("tensor %d: part at offset %d, expected %d" % (
                t, part.offset, got), method=self.method)
        end = got + len(part.data)
        if end > len(buf):
            raise errors.ProtocolError("tensor %d: %d bytes, more than its %d" % (
                t, end, len(buf)), method=self.method)
        # numpy's copy releases the GIL for large parts; a memoryview's would hold it.
        buf[got:end] = np.frombuffer(part.data, np.uint8)
        self.filled[t] = end
        self.received += len(part.data)

    def finish(self):
        out = {}
        for t in self.order:
            if self.filled[t] != len(self.bufs[t]):
                raise errors.ProtocolError("tensor %d: got %d of %d bytes" % (
                    t, self.filled[t], len(self.bufs[t])), method=self.method)
            dt, shape = self.specs[t]
            if t in self.into:
                target = self.into[t]
                out[t] = BF16Array(target) if dt == pb.DTYPE_BF16 else target
            else:
                out[t] = from_wire(dt, shape, self.bufs[t])
        return out

