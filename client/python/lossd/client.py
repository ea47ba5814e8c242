"""The numpy-level lossd client: one method per RPC of lossd.v1.Loss, plus health checks.

Tensors go out as TensorPart messages of at most `part_bytes` bytes each, in byte order, and
come back the same way; the client checks every reply against the wire contract (order,
offsets, sizes) and raises a LossdError subclass for any failure. It never converts dtypes
behind the caller's back: bf16 travels as bf16 (see lossd.tensors.BF16Array).
"""

import collections
import dataclasses
import itertools
import secrets
import threading
import time
from typing import Any, Optional

import grpc
import numpy as np

from lossd import errors
from lossd._proto import pb, pb_grpc
from lossd.tensors import (FLOAT_DTYPES, INT_DTYPES, BF16Array, dtype_name, from_wire,
                           numpy_dtype, parse_dtype, to_wire)

# Data bytes per TensorPart message (the wire contract's default bound).
DEFAULT_PART_BYTES = 4 << 20
# Channel message limits: parts of 16 MiB and more must fit (gRPC's default receive limit is
# 4 MiB).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# Per-call deadline unless the caller says otherwise (the C++ client's default too).
DEFAULT_TIMEOUT_S = 600.0
# Striping's default rule (stripes=0): tensors of at least this many bytes go over
# min(connections, DEFAULT_MAX_STRIPES) connections at once; one connection tops out near
# 4.5 GB/s, four give 3-6x.
DEFAULT_AUTO_STRIPE_BYTES = 64 << 20
DEFAULT_MAX_STRIPES = 4
_MAX_STRIPES = 64  # the server's limit per upload
_REMEMBERED_ACCUMULATORS = 1024  # accumulator instances a client keeps (see _acc_instances)
# After a stripe hears ABORTED (the server aborted the whole upload and tells every stripe),
# how long the others may take to report before they are cancelled: the stripe that caused the
# abort is then heard with its own error.
_ABORTED_GRACE_S = 1.0

_REDUCTIONS = {"mean": pb.REDUCTION_MEAN, "sum": pb.REDUCTION_SUM, "none": pb.REDUCTION_NONE}

_OUTPUT_NAMES = {
    pb.TENSOR_LOSS: "per_token_loss",
    pb.TENSOR_LSE: "lse",
    pb.TENSOR_Z_LOSS: "per_token_z_loss",
    pb.TENSOR_PREDICTIONS: "predictions",
    pb.TENSOR_DX: "dx",
    pb.TENSOR_DW: "dw",
    pb.TENSOR_DB: "db",
}


@dataclasses.dataclass
class ComputeResult:
    """What one Compute returned. Tensors not asked for (or not sent) are None."""

    loss: float  # mean or sum; with reduction none the sum of the per-token loss
    z_loss: float  # same reduction as loss
    accuracy: float  # fraction of non-ignored tokens whose argmax is the target
    tokens: int  # non-ignored tokens
    compute_seconds: float
    backend: str
    accumulated_micro_batches: int
    wall_seconds: float = 0.0  # client-side, the whole call
    bytes_sent: int = 0  # tensor data bytes
    bytes_received: int = 0  # tensor data bytes
    instance: str = ""  # the server instance that computed
    dx: Any = None  # (BT, H) grad dtype
    dw: Any = None  # (V, H) grad dtype
    db: Any = None  # (V) grad dtype
    lse: Optional[np.ndarray] = None  # (BT) fp32
    per_token_loss: Optional[np.ndarray] = None  # (BT) fp32, reduction none
    per_token_z_loss: Optional[np.ndarray] = None  # (BT) fp32, reduction none
    predictions: Optional[np.ndarray] = None  # (BT) int64
    # Gradients holding NaN or Inf after the call ("dx", "dw", "db"); with an accumulator,
    # "dw"/"db" mean its sum, which then refuses further use until a reset fetch or a drop.
    nonfinite: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class WeightHandle:
    """A weight (and optional bias) uploaded with put_weights. Pass it as `w` to compute."""

    handle: str
    bytes: int
    v: int
    h: int
    dtype: str
    has_bias: bool
    stripes: int = 1  # streams (connections) the upload was split over

    def __str__(self):
        return self.handle


@dataclasses.dataclass
class Gradients:
    """A server-side accumulator's contents (fp32)."""

    dw: np.ndarray  # (V, H) fp32
    db: Optional[np.ndarray]  # (V) fp32, None when no bias was used
    micro_batches: int
    tokens: int
    instance: str
    stripes: int = 1  # range streams (connections) the fetch was split over
    ranges: int = 1  # ranged fetches it took (more than stripes where the server's budget is small)


@dataclasses.dataclass
class ServerInfo:
    version: str
    instance: str
    backend: str
    device: str
    memory_total_bytes: int
    memory_budget_bytes: int
    memory_in_use_bytes: int
    weight_cache_budget_bytes: int
    weight_cache_bytes: int
    max_part_bytes: int
    max_bt: int
    max_h: int
    max_v: int
    max_in_flight: int
    accumulators: int
    features: list = dataclasses.field(default_factory=list)  # see require_feature


@dataclasses.dataclass
class StateEntry:
    """One weight handle or accumulator of the caller's, as Client.list_state reports it."""

    kind: str  # "weights" or "accumulator"
    name: str  # the weight handle or the accumulator's name
    bytes: int  # server memory it holds
    last_used_unix_ms: int  # created, or last named by a call
    micro_batches: int = 0  # accumulators: micro-batches summed since the last reset


_STATE_KINDS = {pb.STATE_WEIGHTS: "weights", pb.STATE_ACCUMULATOR: "accumulator"}


def _parts(tensor_id, arr, part_bytes, begin=0, end=None):
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


class _StripeGroup:
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


def _check_gradients_header(header, method="FetchGradients"):
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


class _RangeReceiver:
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


class _Assembler:
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
            self.bufs[tensor_id] = mv.cast("B")
        else:
            self.bufs[tensor_id] = bytearray(nbytes)
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
        buf[got:end] = part.data
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


def _returned_outputs(header, xdt, xshape, wshape, has_bias):
    """{output name: (dtype, shape)} of what a Compute with `header` returns; shapes hold
    None where the request does not tell (V behind a bare handle string; has_bias None)."""
    bt = xshape[0] if xshape else None
    h = xshape[1] if len(xshape) > 1 else None
    v = wshape[0] if wshape else None
    gdt = pb.DTYPE_FP32 if header.options.grad_dtype == pb.DTYPE_FP32 else xdt
    none = header.options.reduction == pb.REDUCTION_NONE
    o = header.outputs
    got = {}
    if none:
        got["per_token_loss"] = (pb.DTYPE_FP32, (bt,))
        if o.z_loss:
            got["per_token_z_loss"] = (pb.DTYPE_FP32, (bt,))
    if o.lse:
        got["lse"] = (pb.DTYPE_FP32, (bt,))
    if o.predictions:
        got["predictions"] = (pb.DTYPE_INT64, (bt,))
    if o.dx:
        got["dx"] = (gdt, (bt, h))
    if o.dw:
        got["dw"] = (gdt, None if v is None else (v, h))
    if o.db and has_bias is not False:  # None: a bare handle string, which may carry one
        got["db"] = (gdt, None if v is None else (v,))
    return got


class Client:
    """A connection to one lossd server (or a load-balanced name: see `channel_options`).
    Thread-safe: share one client among threads.

    target: "host:port" (any gRPC target, e.g. "dns:///lossd-headless:50051").
    part_bytes: data bytes per outgoing TensorPart (default 4 MiB; 1-4 MiB moves fastest),
      rounded down to whole elements of each tensor (at least one element).
    response_part_bytes: data bytes per reply part the server should use (0 = its default;
      at least 1024 otherwise, or the server refuses the call with INVALID_ARGUMENT).
    timeout: default deadline in seconds for every call (default 600; None = no deadline);
      each method takes its own `timeout` too.
    max_message_bytes: the channel's send and receive message limits.
    connections: channels to open, each its own TCP connection; calls round-robin over them
      (one connection tops out at a few GB/s).
    stripes: how many connections one put_weights / fetch_gradients is split over, each
      carrying a byte range on its own stream (four give 3-6x one). 0 = the default rule:
      min(connections, 4) for tensors of at least auto_stripe_bytes (64 MiB), else 1; 1 =
      never. At most `connections` (so with one connection striping is off).
    wait_for_ready: wait for the server to become reachable (until the deadline) instead of
      failing fast with UnavailableError.
    metadata: [(key, value)] added to every call.
    auth_token: a bearer token (servers started with --auth_tokens_file); sent as
      "authorization: Bearer <token>" metadata.
    tls_ca_file / tls_cert_file / tls_key_file: PEM files for TLS (servers started with
      --tls_cert): the CA that signed the server's certificate (None = the system roots), and a
      client certificate and key for mutual TLS (--tls_client_ca). tls=True turns TLS on with
      the system roots alone. tls_server_name overrides the name checked in the certificate.
    channel_options: extra gRPC channel arguments, e.g.
      [("grpc.lb_policy_name", "round_robin")] for client-side balancing over a headless
      Service.
    overlap: compute() overlaps transfer with compute (ComputeHeader.overlap): the server
      computes each chunk of rows as its part of X arrives and sends dX back while later
      chunks compute, so a call takes about max(transfer, compute) instead of their sum.
      The cost: once computing has started, a call that fails (cut off, a NaN in a late part
      of X) poisons the named accumulator, as a failed update always does. Per call:
      compute(overlap=...).
    credentials: grpc.ChannelCredentials (instead of the tls_* files); None = plaintext.
    channel: an existing grpc.Channel to use instead (target and the above are then ignored).
    """

    def __init__(self, target="localhost:50051", *, part_bytes=DEFAULT_PART_BYTES,
                 response_part_bytes=0, timeout=DEFAULT_TIMEOUT_S,
                 max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, connections=1, stripes=0,
                 auto_stripe_bytes=DEFAULT_AUTO_STRIPE_BYTES, wait_for_ready=False, metadata=None, auth_token=None, tls=False,
                 tls_ca_file=None, tls_cert_file=None, tls_key_file=None, tls_server_name=None,
                 channel_options=None, credentials=None, channel=None, overlap=True):
        if int(part_bytes) <= 0:
            raise errors.InvalidArgumentError("part_bytes must be positive, got %r" % part_bytes)
        if int(connections) < 1:
            raise errors.InvalidArgumentError("connections must be >= 1, got %r" % connections)
        if not 0 <= int(stripes) <= _MAX_STRIPES:
            raise errors.InvalidArgumentError(
                "stripes must be in [0, %d] (0 = the default rule), got %r" % (_MAX_STRIPES,
                                                                             stripes))
        n_channels = 1 if channel is not None else int(connections)
        if int(stripes) > n_channels:
            raise errors.InvalidArgumentError(
                "stripes=%d needs as many connections, got %d: each stripe is a stream on a "
                "connection of its own" % (int(stripes), n_channels))
        self.stripes = int(stripes)
        self.auto_stripe_bytes = int(auto_stripe_bytes)
        if int(part_bytes) > int(max_message_bytes) - 1024:
            raise errors.InvalidArgumentError(
                "part_bytes %d does not fit in max_message_bytes %d" % (part_bytes,
                                                                        max_message_bytes))
        self.target = target
        self.part_bytes = int(part_bytes)
        self.response_part_bytes = int(response_part_bytes)
        self.overlap = bool(overlap)
        self.timeout = timeout
        self._wait_ready = bool(wait_for_ready)  # not wait_for_ready: that is a method
        self.metadata = tuple(metadata or ())
        if auth_token:
            self.metadata += (("authorization", "Bearer %s" % auth_token),)
        if (tls_cert_file is None) != (tls_key_file is None):
            raise errors.InvalidArgumentError("tls_cert_file and tls_key_file go together")
        if credentials is None and (tls or tls_ca_file or tls_cert_file):
            def read(path):
                if path is None:
                    return None
                with open(path, "rb") as f:
                    return f.read()

            credentials = grpc.ssl_channel_credentials(
                root_certificates=read(tls_ca_file), private_key=read(tls_key_file),
                certificate_chain=read(tls_cert_file))
        self._own_channel = channel is None
        if channel is None:
            opts = [("grpc.max_receive_message_length", int(max_message_bytes)),
                    ("grpc.max_send_message_length", int(max_message_bytes))]
            if tls_server_name:
                opts.append(("grpc.ssl_target_name_override", tls_server_name))
            if int(connections) > 1:
                # A private subchannel pool per channel: otherwise gRPC shares one connection.
                opts.append(("grpc.use_local_subchannel_pool", 1))
            opts += list(channel_options or [])
            channels = []
            for _ in range(int(connections)):
                if credentials is not None:
                    channels.append(grpc.secure_channel(target, credentials, options=opts))
                else:
                    channels.append(grpc.insecure_channel(target, options=opts))
        else:
            channels = [channel]
        self._channels = channels
        self.channel = channels[0]
        self._stubs = [pb_grpc.LossStub(c) for c in channels]
        self._next = itertools.count()
        self._next_lock = threading.Lock()
        # Accumulator name -> the server instance its sum began on (at most
        # _REMEMBERED_ACCUMULATORS, the least recently used forgotten first): later computes
        # and fetches name it, and a server of another instance refuses them.
        self._acc_instances = collections.OrderedDict()
        self._acc_lock = threading.Lock()
        self._features = None  # (version, frozenset of names) from the first server_info
        self._closed = False

    # -- plumbing -----------------------------------------------------------------------

    def close(self):
        """Closes the channels this client opened (not one it was given). Later calls raise
        ClientClosedError; closing twice is harmless."""
        self._closed = True
        if self._own_channel:
            for c in self._channels:
                c.close()

    def _check_open(self, method):
        if self._closed:
            raise errors.ClientClosedError(
                "this lossd.Client (target %s) was closed; make a new one" % self.target,
                method=method)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def _stub(self):
        self._check_open(None)
        with self._next_lock:
            i = next(self._next)
        return self._stubs[i % len(self._stubs)]

    def _next_stubs(self, n):
        """n distinct stubs (n <= connections), taken round-robin."""
        self._check_open(None)
        with self._next_lock:
            first = next(self._next)
            for _ in range(n - 1):
                next(self._next)
        return [self._stubs[(first + i) % len(self._stubs)] for i in range(n)]

    def _acc_instance(self, accumulator):
        with self._acc_lock:
            return self._acc_instances.get(accumulator, "")

    def _remember_instance(self, accumulator, instance):
        """Pins the accumulator to the instance that computed (least recently used forgotten
        first). First computes into a new accumulator sent at once, before any of them came
        back, were not pinned: one that reached another instance raises here."""
        if not instance:
            return
        with self._acc_lock:
            known = self._acc_instances.get(accumulator)
            if known is not None:
                self._acc_instances.move_to_end(accumulator)
                if known != instance:
                    raise errors.FailedPreconditionError(
                        "accumulator %r began on server instance %r, but this compute was "
                        "added to one on instance %r (concurrent first computes reached "
                        "different replicas): the sum is split; drop the accumulator and redo "
                        "the step on one replica" % (accumulator, known, instance),
                        method="Compute")
                return
            if len(self._acc_instances) >= _REMEMBERED_ACCUMULATORS:
                self._acc_instances.popitem(last=False)
            self._acc_instances[accumulator] = instance

    def _stripes_for(self, nbytes):
        if self.stripes > 0:
            return self.stripes
        if nbytes < self.auto_stripe_bytes:
            return 1
        return min(len(self._stubs), DEFAULT_MAX_STRIPES)

    def _call_kwargs(self, timeout):
        """timeout: None = the client's default; a number of seconds; or float('inf')."""
        t = self.timeout if timeout is None else timeout
        if t is not None and t == float("inf"):
            t = None
        kw = {"timeout": t, "wait_for_ready": self._wait_ready}
        if self.metadata:
            kw["metadata"] = self.metadata
        return kw

    def wait_for_ready(self, timeout=30.0):
        """Blocks until the channel connects; raises UnavailableError after `timeout` s."""
        self._check_open("connect")
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.UnavailableError("no connection to %s within %.1f s" % (
                self.target, timeout), method="connect") from None

    def health(self, service="", timeout=None):
        """grpc.health.v1 Check: returns the status name, e.g. "SERVING"."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        self._check_open("Health.Check")
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service),
                              **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "Health.Check") from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    # -- RPCs ---------------------------------------------------------------------------

    def server_info(self, timeout=None):
        try:
            r = self._stub.ServerInfo(pb.ServerInfoRequest(), **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "ServerInfo") from None
        info = ServerInfo(**{f.name: getattr(r, f.name) for f in dataclasses.fields(ServerInfo)})
        info.features = list(info.features)
        return info

    def require_feature(self, name, *, timeout=None):
        """Returns when the server lists `name` in ServerInfo.features; else raises
        UnimplementedError naming the feature and the server's version. Asks server_info once
        and remembers the answer. Call it before sending a field the feature guards: an older
        server refuses (or, older still, ignores) a field it does not know."""
        known = self._features
        if known is None:
            info = self.server_info(timeout=timeout)
            known = self._features = (info.version, frozenset(info.features))
        if name not in known[1]:
            raise errors.UnimplementedError(
                "the server (lossd %s) does not support '%s' (not in its ServerInfo.features): "
                "upgrade the server to use it" % (known[0], name), method="require_feature")

    def put_weights(self, w, bias=None, *, timeout=None):
        """Uploads W (V, H) and an optional bias (V) once; returns a WeightHandle for compute.

        The server keeps them in its weight cache (LRU, memory-budgeted); a handle it has
        evicted or dropped, or one from before a restart, fails with NotFoundError: upload
        again.

        Striped (see `stripes`): W is cut into element-aligned byte ranges sent at once, one
        stream per connection, under one random upload id; the bias goes with the first. The
        server makes the handle once every range has arrived; if any stripe fails the whole
        upload is aborted, no handle exists, and the first error that is not the siblings'
        AbortedError is raised.
        """
        wdt, wshape, warr = to_wire(w, "w", FLOAT_DTYPES)
        if len(wshape) != 2:
            raise errors.InvalidArgumentError("w must be (V, H), got shape %s" % (wshape,))
        header = pb.WeightsHeader(w=pb.TensorSpec(dtype=wdt, shape=wshape))
        barr = None
        if bias is not None:
            bdt, bshape, barr = to_wire(bias, "bias", FLOAT_DTYPES)
            header.bias.CopyFrom(pb.TensorSpec(dtype=bdt, shape=bshape))
        part_bytes = self.part_bytes
        elems = int(warr.size)
        stripes = min(self._stripes_for(warr.nbytes + (barr.nbytes if barr is not None else 0)),
                      elems)

        def requests(head, begin, end, with_bias):
            yield pb.PutWeightsRequest(header=head)
            for p in _parts(pb.TENSOR_W, warr, part_bytes, begin, end):
                yield pb.PutWeightsRequest(part=p)
            if with_bias:
                for p in _parts(pb.TENSOR_BIAS, barr, part_bytes):
                    yield pb.PutWeightsRequest(part=p)

        def result(r, n):
            if not r.handle:
                raise errors.ProtocolError("empty handle", method="PutWeights")
            return WeightHandle(handle=r.handle, bytes=r.bytes, v=wshape[0], h=wshape[1],
                                dtype=dtype_name(wdt), has_bias=barr is not None, stripes=n)

        if stripes <= 1:
            try:
                r = self._stub.PutWeights(requests(header, 0, warr.nbytes, barr is not None),
                                          **self._call_kwargs(timeout))
            except grpc.RpcError as e:
                raise errors.from_rpc_error(e, "PutWeights") from None
            return result(r, 1)

        upload_id = secrets.token_hex(16)
        stubs = self._next_stubs(stripes)
        kw = self._call_kwargs(timeout)
        replies = [None] * stripes
        group = _StripeGroup(stripes, _ABORTED_GRACE_S)
        elem = warr.itemsize

        def stripe(i):
            begin = elem * (elems * i // stripes)
            end = elem * (elems * (i + 1) // stripes)
            head = pb.WeightsHeader()
            head.CopyFrom(header)
            head.upload_id = upload_id
            head.stripes = stripes
            head.w_begin = begin
            head.w_end = end
            fut = stubs[i].PutWeights.future(
                requests(head, begin, end, i == 0 and barr is not None), **kw)
            group.register(i, fut)
            try:
                replies[i] = fut.result()
            except grpc.RpcError as e:
                raise errors.from_rpc_error(e, "PutWeights") from None
            except grpc.FutureCancelledError:
                raise errors.CancelledError("cancelled: another stripe failed",
                                            method="PutWeights") from None

        group.run(stripe)
        handles = {r.handle for r in replies}
        if len(handles) != 1:
            raise errors.ProtocolError("stripes of upload %s got different handles: %s" % (
                upload_id, sorted(handles)), method="PutWeights")
        return result(replies[0], stripes)

    def drop_weights(self, handle, *, timeout=None):
        try:
            self._stub.DropWeights(pb.DropWeightsRequest(handle=str(handle)),
                                   **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "DropWeights") from None

    def fetch_gradients(self, accumulator, *, reset=False, response_part_bytes=None,
                        timeout=None):
        """Reads a server-side accumulator (fp32 dW and db); `reset` zeroes it after.

        Striped (see `stripes`; needs connections > 1): a one-value ranged fetch first learns
        the accumulator's size (one extra round trip), then byte ranges of dW | db are fetched
        at once, one stream per connection, straight into the result. Every range must report
        the micro_batches and tokens of the first look, else AbortedError (a compute added to
        the accumulator in between: fetch again). A ranged fetch cannot reset, so `reset` then
        drops the accumulator after the last range has arrived: the next compute naming it
        creates it again, zeroed, and until then fetching it raises NotFoundError rather than
        returning zeros. A compute adding to it while a striped reset is under way may be lost
        with it; a whole fetch resets atomically.

        A server refuses (ResourceExhaustedError) to copy more than its whole
        --memory_budget_bytes at once. Then the fetch asks for server_info and goes on in
        ranges of at most half that budget (fetch_ranges_within), one after another on each
        stream, with the same checks and the same reset-by-drop as striping.
        """
        rpb = self.response_part_bytes if response_part_bytes is None else response_part_bytes
        if self.stripes > 1 or (self.stripes == 0 and len(self._stubs) > 1):
            got = self._fetch_striped(accumulator, reset, int(rpb), timeout)
            if got is not None:
                return got
        req = pb.FetchGradientsRequest(accumulator=accumulator, reset=reset,
                                       response_part_bytes=int(rpb),
                                       accumulator_instance=self._acc_instance(accumulator))
        asm = _Assembler("FetchGradients")
        header = None
        try:
            for msg in self._stub.FetchGradients(req, **self._call_kwargs(timeout)):
                kind = msg.WhichOneof("kind")
                if kind == "header":
                    if header is not None:
                        raise errors.ProtocolError("two headers", method="FetchGradients")
                    header = msg.header
                    asm.expect(pb.TENSOR_DW, header.dw)
                    if header.HasField("db") and len(header.db.shape) > 0:
                        asm.expect(pb.TENSOR_DB, header.db)
                elif kind == "part":
                    if header is None:
                        raise errors.ProtocolError("part before header", method="FetchGradients")
                    asm.add(msg.part)
        except grpc.RpcError as e:
            err = errors.from_rpc_error(e, "FetchGradients")
            refused = header is None and isinstance(err, errors.ResourceExhaustedError)
        else:
            refused = False
            err = None
        if refused:
            # Refused before its header (so nothing was reset) for want of memory: it may be
            # larger than the server's whole memory budget, which ranges can fit.
            return self._fetch_striped(accumulator, reset, int(rpb), timeout, refused=err)
        if err is not None:
            raise err
        if header is None:
            raise errors.ProtocolError("no header in reply", method="FetchGradients")
        t = asm.finish()
        return Gradients(dw=t[pb.TENSOR_DW], db=t.get(pb.TENSOR_DB),
                         micro_batches=header.micro_batches, tokens=header.tokens,
                         instance=header.instance)

    def _fetch_range(self, stub, accumulator, begin, end, rpb, kw, on_header, group=None, i=0):
        """One ranged FetchGradients stream; on_header(header) returns a _RangeReceiver."""
        req = pb.FetchGradientsRequest(accumulator=accumulator, response_part_bytes=rpb,
                                       range_begin=begin, range_end=end,
                                       accumulator_instance=self._acc_instance(accumulator))
        header, recv, db_bytes, call = None, None, 0, None
        try:
            call = stub.FetchGradients(req, **kw)
            if group is not None:
                group.register(i, call)
            for msg in call:
                kind = msg.WhichOneof("kind")
                if kind == "header":
                    if header is not None:
                        raise errors.ProtocolError("two headers", method="FetchGradients")
                    header = msg.header
                    _, _, dw_bytes, db_bytes = _check_gradients_header(header)
                    if end > dw_bytes + db_bytes:
                        raise errors.ProtocolError(
                            "range [%d, %d) answered for an accumulator of %d bytes" % (
                                begin, end, dw_bytes + db_bytes), method="FetchGradients")
                    recv = on_header(header, dw_bytes)
                elif kind == "part":
                    if header is None:
                        raise errors.ProtocolError("part before header", method="FetchGradients")
                    recv.add(msg.part, db_bytes)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "FetchGradients") from None
        except BaseException:
            if call is not None:
                call.cancel()  # a reply that broke the contract: stop the stream
            raise
        if header is None:
            raise errors.ProtocolError("no header in reply", method="FetchGradients")
        recv.finish()
        return header

    def _fetch_striped(self, accumulator, reset, rpb, timeout, refused=None):
        """The striped fetch, or None when the accumulator is too small to stripe.

        refused: the ResourceExhaustedError of a whole fetch; then ranges on one stream, as
        many as the server's memory budget needs, or that error where ranges cannot help."""
        kw = self._call_kwargs(timeout)
        look = self._fetch_range(self._stub, accumulator, 0, 4, rpb, kw,
                                 lambda h, dw_bytes: _RangeReceiver(0, 4, dw_bytes))
        dw_shape, db_shape, dw_bytes, db_bytes = _check_gradients_header(look)
        total = dw_bytes + db_bytes
        stripes = 1 if refused is not None else min(self._stripes_for(total), total // 4)
        if stripes <= 1 and refused is None:
            return None

        def ranges_within_budget(refusal):
            try:
                budget = self.server_info(timeout=timeout).memory_budget_bytes
            except errors.LossdError:
                raise refusal from None
            n = fetch_ranges_within(total, budget, stripes)
            if n == 0:
                raise refusal
            return n

        ranges = stripes if refused is None else ranges_within_budget(refused)
        dw = np.empty(dw_shape, dtype=np.float32)
        db = np.empty(db_shape, dtype=np.float32) if db_shape is not None else None
        dw_mv = memoryview(dw).cast("B")
        db_mv = memoryview(db).cast("B") if db is not None else None
        first = (look.dw.SerializeToString(), look.HasField("db"), look.db.SerializeToString(),
                 look.micro_batches, look.tokens, look.instance)
        values = total // 4
        stubs = self._next_stubs(stripes)

        def fetch_ranges(n):
            """`stripes` streams at once, each fetching its share of n ranges in turn."""

            def stripe(i):
                for j in range(i, n, stripes):
                    begin, end = 4 * (values * j // n), 4 * (values * (j + 1) // n)

                    def on_header(h, n_dw, begin=begin, end=end):
                        now = (h.dw.SerializeToString(), h.HasField("db"),
                               h.db.SerializeToString(), h.micro_batches, h.tokens, h.instance)
                        if now != first:
                            raise errors.AbortedError(
                                "accumulator %r changed while its ranges were fetched "
                                "(micro_batches %d then %d, tokens %d then %d): a compute "
                                "added to it in between; fetch again" % (
                                    accumulator, look.micro_batches, h.micro_batches,
                                    look.tokens, h.tokens), method="FetchGradients")
                        return _RangeReceiver(begin, end, n_dw, dw_mv, db_mv)

                    self._fetch_range(stubs[i], accumulator, begin, end, rpb, kw, on_header,
                                      group, i)

            group = _StripeGroup(stripes, 0.0)
            group.run(stripe)

        try:
            fetch_ranges(ranges)
        except errors.ResourceExhaustedError as e:
            if refused is not None:
                raise
            # Striped ranges can each be larger than the budget too. Ranges change nothing on
            # the server, so fetching them again is safe.
            ranges = ranges_within_budget(e)
            fetch_ranges(ranges)
        if reset:
            # A ranged fetch cannot reset: drop it instead, now that every range is here.
            self.drop_accumulator(accumulator, timeout=timeout)
        return Gradients(dw=dw, db=db, micro_batches=look.micro_batches, tokens=look.tokens,
                         instance=look.instance, stripes=stripes, ranges=ranges)

    def list_state(self, *, timeout=None):
        """The caller's own weight handles and accumulators (what its credential created;
        everything on a server that checks none), as StateEntry. Needs a server with the
        "list_state" feature (UnimplementedError naming it otherwise)."""
        self.require_feature("list_state", timeout=timeout)
        try:
            r = self._stub.List(pb.ListRequest(), **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "List") from None
        return [StateEntry(kind=_STATE_KINDS.get(e.kind, str(e.kind)), name=e.name,
                           bytes=e.bytes, last_used_unix_ms=e.last_used_unix_ms,
                           micro_batches=e.micro_batches) for e in r.entries]

    def drop_accumulator(self, accumulator, *, timeout=None):
        """Drops a server-side accumulator. Also forgets its server instance, whatever the
        server answers: the next compute into that name may begin a new sum anywhere."""
        with self._acc_lock:
            self._acc_instances.pop(accumulator, None)
        try:
            self._stub.DropAccumulator(pb.DropAccumulatorRequest(accumulator=accumulator),
                                       **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "DropAccumulator") from None

    def compute(self, x, w, targets, *, bias=None, class_weights=None, grad_output=None,
                ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                softcap=None, grad_dtype=None, grad_scale=None, chunk_rows=0,
                token_scaling=False, want_dx=True, want_dw=True, want_db=None, want_lse=False, want_z_loss=False,
                want_accuracy=False, want_predictions=False, accumulator=None,
                response_part_bytes=None, out=None, timeout=None, overlap=None):
        """Linear + cross-entropy forward and backward on the server.

        x: (BT, H) bf16 / fp16 / fp32 (BF16Array, numpy array, or torch tensor).
        w: (V, H) same dtype as x, or a WeightHandle (or its handle string) from put_weights.
        targets: (BT) int32 or int64 (any integer array is sent as int64).
        bias: (V), inline weights only (a handle carries its own bias).
        class_weights: (V) fp32, PyTorch's cross_entropy `weight`.
        grad_output: (BT) fp32 upstream gradient, reduction "none" only (default ones).
        reduction: "mean" | "sum" | "none". softcap: None or 0 = off.
        The option defaults are the server's, kept in one place (core/loss_problem.h).
        grad_dtype: None = the input dtype, or "fp32".
        grad_scale: upstream gradient of the scalar loss (mean, sum); default 1.
        chunk_rows: rows per chunk, 0 = the server chooses.
        token_scaling: Liger's use_token_scaling: each token's loss and gradient times its
          target's probability (servers listing the "token_scaling" feature).
        want_*: which outputs to return (the loss always is). want_db defaults to "a bias is
          in use" (for a bare handle string: asked for, and it comes if the handle has one).
          With `accumulator`, dW and db are added to that server-side fp32 accumulator
          (created on first use) instead of being returned. The client remembers the server
          instance of each accumulator it added to: a server of another instance
          (another replica behind a balancer, or this one restarted) then refuses the call
          (FailedPreconditionError) instead of starting a second, partial sum;
          drop_accumulator forgets it.
        out: {"dx": array, "dw": ..., "lse": ...} caller buffers (C-contiguous, writable, of
          the output's exact dtype and shape; a BF16Array or uint16 array for bf16) to
          receive outputs into without a copy; the result then holds those same arrays. A
          buffer that does not fit, or one for an output the call does not return, is refused
          before anything is sent.
        timeout: seconds (None = the client's default, float("inf") = none).
        overlap: None = the client's setting (see Client).
        """
        t_start = time.perf_counter()
        if reduction not in _REDUCTIONS:
            raise errors.InvalidArgumentError(
                "reduction must be 'mean', 'sum' or 'none', got %r" % (reduction,))
        handle = None
        if isinstance(w, (WeightHandle, str)):
            handle = str(w)
            if bias is not None:
                raise errors.InvalidArgumentError(
                    "bias given with a weight handle: the handle carries its own bias")
        xdt, xshape, xarr = to_wire(x, "x", FLOAT_DTYPES)
        tdt, tshape, tarr = to_wire(targets, "targets", INT_DTYPES)
        header = pb.ComputeHeader(x=pb.TensorSpec(dtype=xdt, shape=xshape),
                                  targets=pb.TensorSpec(dtype=tdt, shape=tshape))
        inline = []  # (tensor id, array), sent small first, X last so compute can start early
        inline.append((pb.TENSOR_TARGETS, tarr))
        if handle is not None:
            header.weight_handle = handle
            # A bare handle string does not say: db is asked for, and comes only with a bias.
            has_bias = w.has_bias if isinstance(w, WeightHandle) else None
        else:
            wdt, wshape, warr = to_wire(w, "w", FLOAT_DTYPES)
            header.w.CopyFrom(pb.TensorSpec(dtype=wdt, shape=wshape))
            has_bias = bias is not None
            if has_bias:
                bdt, bshape, barr = to_wire(bias, "bias", FLOAT_DTYPES)
                header.bias.CopyFrom(pb.TensorSpec(dtype=bdt, shape=bshape))
                inline.append((pb.TENSOR_BIAS, barr))
        if class_weights is not None:
            cdt, cshape, carr = to_wire(class_weights, "class_weights", (pb.DTYPE_FP32,))
            header.class_weights.CopyFrom(pb.TensorSpec(dtype=cdt, shape=cshape))
            inline.append((pb.TENSOR_CLASS_WEIGHTS, carr))
        if grad_output is not None:
            if reduction != "none":
                raise errors.InvalidArgumentError(
                    "grad_output is for reduction 'none'; use grad_scale with %r" % reduction)
            gdt, gshape, garr = to_wire(grad_output, "grad_output", (pb.DTYPE_FP32,))
            header.grad_output.CopyFrom(pb.TensorSpec(dtype=gdt, shape=gshape))
            inline.append((pb.TENSOR_GRAD_OUTPUT, garr))
        if handle is None:
            inline.append((pb.TENSOR_W, warr))
        inline.append((pb.TENSOR_X, xarr))

        opts = header.options
        opts.ignore_index = int(ignore_index)
        opts.reduction = _REDUCTIONS[reduction]
        opts.label_smoothing = float(label_smoothing)
        opts.lse_square_scale = float(lse_square_scale)
        opts.softcap = float(softcap or 0.0)
        gd = parse_dtype(grad_dtype)
        if gd not in (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FP32, xdt):
            raise errors.InvalidArgumentError(
                "grad_dtype must be the input dtype (%s) or fp32, got %s" % (
                    dtype_name(xdt), dtype_name(gd)))
        opts.grad_dtype = pb.DTYPE_UNSPECIFIED if gd == xdt else gd
        if grad_scale is not None:
            opts.grad_scale = float(grad_scale)
        opts.chunk_rows = int(chunk_rows)
        opts.token_scaling = bool(token_scaling)
        outs = header.outputs
        outs.dx = bool(want_dx)
        outs.dw = bool(want_dw) and not accumulator
        outs.db = bool((has_bias is not False) if want_db is None else want_db) and not accumulator
        outs.lse = bool(want_lse)
        outs.z_loss = bool(want_z_loss)
        outs.accuracy = bool(want_accuracy)
        outs.predictions = bool(want_predictions)
        if accumulator:
            header.accumulator = accumulator
            header.accumulator_instance = self._acc_instance(accumulator)
        rpb = self.response_part_bytes if response_part_bytes is None else response_part_bytes
        header.response_part_bytes = int(rpb)
        overlapped = self.overlap if overlap is None else bool(overlap)
        header.overlap = overlapped
        part_bytes = self.part_bytes

        bytes_sent = sum(arr.nbytes for _, arr in inline)

        def requests():
            yield pb.ComputeRequest(header=header)
            for tid, arr in inline:
                for p in _parts(tid, arr, part_bytes):
                    yield pb.ComputeRequest(part=p)

        into = {}
        by_name = {v: k for k, v in _OUTPUT_NAMES.items()}
        # Caller buffers are checked before anything is sent: found wrong once the server has
        # answered, a micro-batch would already be in its accumulator, and a retry would add
        # it twice.
        returned = _returned_outputs(header, xdt, xshape, wshape if handle is None else (
            (w.v, w.h) if isinstance(w, WeightHandle) else None),
            has_bias)
        for name, buf in (out or {}).items():
            if name not in by_name:
                raise errors.InvalidArgumentError("out: unknown output %r (one of %s)" % (
                    name, ", ".join(sorted(by_name))))
            arr = buf.bits if isinstance(buf, BF16Array) else buf
            if name not in returned:
                raise errors.InvalidArgumentError(
                    "out[%r]: this call does not return %s (see want_* and accumulator)" % (
                        name, name))
            dt, shape = returned[name]
            if isinstance(arr, np.ndarray):
                want_np = numpy_dtype(dt)
                if arr.dtype != want_np or (shape is not None and arr.shape != shape):
                    raise errors.InvalidArgumentError(
                        "out[%r]: needs a %s array of shape %s (%s), got %s %s" % (
                            name, want_np, "?" if shape is None else shape, dtype_name(dt),
                            arr.dtype, arr.shape))
            try:
                mv = memoryview(arr)
            except TypeError:
                raise errors.InvalidArgumentError(
                    "out[%r]: %s is not a buffer" % (name, type(arr).__name__)) from None
            need = (None if shape is None else
                    int(np.prod(shape, dtype=np.int64)) * np.dtype(numpy_dtype(dt)).itemsize)
            if mv.readonly or not mv.c_contiguous or (need is not None and mv.nbytes != need):
                raise errors.InvalidArgumentError(
                    "out[%r]: needs %s writable C-contiguous bytes, has %d%s%s" % (
                        name, "?" if need is None else need, mv.nbytes,
                        " (read-only)" if mv.readonly else "",
                        "" if mv.c_contiguous else " (not C-contiguous)"))
            into[by_name[name]] = arr
        asm = _Assembler("Compute", into)
        # Without overlap: the summary, then the parts. With overlap: a preliminary summary
        # that announces the outputs, the parts, then the final summary last.
        announced = None  # the summary that listed the outputs
        summary = None    # the one with the results
        try:
            for msg in self._stub.Compute(requests(), **self._call_kwargs(timeout)):
                kind = msg.WhichOneof("kind")
                if kind == "summary":
                    s = msg.summary
                    if summary is not None:
                        raise errors.ProtocolError("two summaries", method="Compute")
                    if len(s.tensors) != len(s.specs):
                        raise errors.ProtocolError("summary lists %d tensors but %d specs" % (
                            len(s.tensors), len(s.specs)), method="Compute")
                    if s.preliminary != (overlapped and announced is None):
                        raise errors.ProtocolError(
                            "a %s summary where a %s one was due" % (
                                "preliminary" if s.preliminary else "final",
                                "final" if s.preliminary else "preliminary"), method="Compute")
                    if announced is None:
                        announced = s
                        for tid, spec in zip(s.tensors, s.specs):
                            asm.expect(tid, spec)
                    elif list(s.tensors) != list(announced.tensors):
                        raise errors.ProtocolError(
                            "the final summary lists other outputs than the preliminary one",
                            method="Compute")
                    if not s.preliminary:
                        summary = s
                elif kind == "part":
                    if announced is None:
                        raise errors.ProtocolError("part before summary", method="Compute")
                    if overlapped and summary is not None:
                        raise errors.ProtocolError("part after the final summary",
                                                   method="Compute")
                    asm.add(msg.part)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "Compute") from None
        if summary is None:
            raise errors.ProtocolError(
                "no final summary in reply" if announced is not None else "no summary in reply",
                method="Compute")
        tensors = asm.finish()
        unfilled = sorted(_OUTPUT_NAMES[t] for t in into if t not in tensors)
        if unfilled:
            # Possible only where the request could not tell: db behind a bare handle string
            # whose weights carry no bias.
            raise errors.InvalidArgumentError(
                "out: the server returned no %s for this call, so the buffer given for it was "
                "not written" % ", ".join(unfilled), method="Compute")
        res = ComputeResult(loss=summary.loss, z_loss=summary.z_loss, accuracy=summary.accuracy,
                            tokens=summary.tokens, compute_seconds=summary.compute_seconds,
                            backend=summary.backend,
                            accumulated_micro_batches=summary.accumulated_micro_batches,
                            wall_seconds=time.perf_counter() - t_start, bytes_sent=bytes_sent,
                            bytes_received=asm.received, instance=summary.instance,
                            nonfinite=[_OUTPUT_NAMES.get(t, str(t)) for t in summary.nonfinite])
        if accumulator:
            self._remember_instance(accumulator, summary.instance)
        for tid, value in tensors.items():
            name = _OUTPUT_NAMES.get(tid)
            if name is None:
                raise errors.ProtocolError("unexpected output tensor %d" % tid, method="Compute")
            setattr(res, name, value)
        return res


def connect(target="localhost:50051", **kwargs) -> Client:
    """Client(target, **kwargs)."""
    return Client(target, **kwargs)


__all__ = ["Client", "ComputeResult", "WeightHandle", "Gradients", "ServerInfo", "StateEntry",
           "connect", "DEFAULT_PART_BYTES"]
