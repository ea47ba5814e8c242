"""The numpy-level lossd client: one method per RPC of lossd.v1.Loss, plus health checks.

Tensors go out as TensorPart messages of at most `part_bytes` bytes each, in byte order, and
come back the same way; the client checks every reply against the wire contract (order,
offsets, sizes) and raises a LossdError subclass for any failure. It never converts dtypes
behind the caller's back: bf16 travels as bf16 (see lossd.tensors.BF16Array).
"""

import dataclasses
import itertools
import threading
import time
from typing import Any, Optional

import grpc
import numpy as np

from lossd import errors
from lossd._proto import pb, pb_grpc
from lossd.tensors import (FLOAT_DTYPES, INT_DTYPES, BF16Array, dtype_name, from_wire,
                           parse_dtype, to_wire)

# Data bytes per TensorPart message (the wire contract's default bound).
DEFAULT_PART_BYTES = 4 << 20
# Channel message limits: parts of 16 MiB and more must fit (gRPC's default receive limit is
# 4 MiB).
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
# Per-call deadline unless the caller says otherwise (the C++ client's default too).
DEFAULT_TIMEOUT_S = 600.0

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
    dx: Any = None  # (BT, H) grad dtype
    dw: Any = None  # (V, H) grad dtype
    db: Any = None  # (V) grad dtype
    lse: Optional[np.ndarray] = None  # (BT) fp32
    per_token_loss: Optional[np.ndarray] = None  # (BT) fp32, reduction none
    per_token_z_loss: Optional[np.ndarray] = None  # (BT) fp32, reduction none
    predictions: Optional[np.ndarray] = None  # (BT) int64


@dataclasses.dataclass(frozen=True)
class WeightHandle:
    """A weight (and optional bias) uploaded with put_weights. Pass it as `w` to compute."""

    handle: str
    bytes: int
    v: int
    h: int
    dtype: str
    has_bias: bool

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


def _parts(tensor_id, arr, part_bytes):
    """Yields TensorPart messages for one tensor, in byte order, each at most part_bytes
    rounded down to whole elements (at least one): servers may refuse a part that splits an
    element."""
    mv = memoryview(arr).cast("B")
    n = len(mv)
    elem = arr.itemsize
    step = max(elem, part_bytes - part_bytes % elem)
    off = 0
    while off < n:
        end = min(n, off + step)
        yield pb.TensorPart(tensor=tensor_id, offset=off, data=mv[off:end].tobytes())
        off = end


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


class Client:
    """A connection to one lossd server (or a load-balanced name: see `channel_options`).
    Thread-safe: share one client among threads.

    target: "host:port" (any gRPC target, e.g. "dns:///lossd-headless:50051").
    part_bytes: data bytes per outgoing TensorPart (default 4 MiB; 1-4 MiB moves fastest),
      rounded down to whole elements of each tensor (at least one element).
    response_part_bytes: data bytes per reply part the server should use (0 = its default).
    timeout: default deadline in seconds for every call (default 600; None = no deadline);
      each method takes its own `timeout` too.
    max_message_bytes: the channel's send and receive message limits.
    connections: channels to open, each its own TCP connection; calls round-robin over them
      (one connection tops out at a few GB/s).
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
    credentials: grpc.ChannelCredentials (instead of the tls_* files); None = plaintext.
    channel: an existing grpc.Channel to use instead (target and the above are then ignored).
    """

    def __init__(self, target="localhost:50051", *, part_bytes=DEFAULT_PART_BYTES,
                 response_part_bytes=0, timeout=DEFAULT_TIMEOUT_S,
                 max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES, connections=1,
                 wait_for_ready=False, metadata=None, auth_token=None, tls=False,
                 tls_ca_file=None, tls_cert_file=None, tls_key_file=None, tls_server_name=None,
                 channel_options=None, credentials=None, channel=None):
        if int(part_bytes) <= 0:
            raise errors.InvalidArgumentError("part_bytes must be positive, got %r" % part_bytes)
        if int(connections) < 1:
            raise errors.InvalidArgumentError("connections must be >= 1, got %r" % connections)
        if int(part_bytes) > int(max_message_bytes) - 1024:
            raise errors.InvalidArgumentError(
                "part_bytes %d does not fit in max_message_bytes %d" % (part_bytes,
                                                                        max_message_bytes))
        self.target = target
        self.part_bytes = int(part_bytes)
        self.response_part_bytes = int(response_part_bytes)
        self.timeout = timeout
        self.wait_for_ready = bool(wait_for_ready)
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

    # -- plumbing -----------------------------------------------------------------------

    def close(self):
        if self._own_channel:
            for c in self._channels:
                c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def _stub(self):
        with self._next_lock:
            i = next(self._next)
        return self._stubs[i % len(self._stubs)]

    def _call_kwargs(self, timeout):
        """timeout: None = the client's default; a number of seconds; or float('inf')."""
        t = self.timeout if timeout is None else timeout
        if t is not None and t == float("inf"):
            t = None
        kw = {"timeout": t, "wait_for_ready": self.wait_for_ready}
        if self.metadata:
            kw["metadata"] = self.metadata
        return kw

    def wait_for_ready(self, timeout=30.0):
        """Blocks until the channel connects; raises UnavailableError after `timeout` s."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.UnavailableError("no connection to %s within %.1f s" % (
                self.target, timeout), method="connect") from None

    def health(self, service="", timeout=None):
        """grpc.health.v1 Check: returns the status name, e.g. "SERVING"."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

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
        return ServerInfo(**{f.name: getattr(r, f.name) for f in dataclasses.fields(ServerInfo)})

    def put_weights(self, w, bias=None, *, timeout=None):
        """Uploads W (V, H) and an optional bias (V) once; returns a WeightHandle for compute.

        The server keeps them in its weight cache (LRU, memory-budgeted); a handle it has
        evicted, or one from before a restart, fails with NotFoundError or
        FailedPreconditionError: upload again.
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

        def requests():
            yield pb.PutWeightsRequest(header=header)
            for p in _parts(pb.TENSOR_W, warr, part_bytes):
                yield pb.PutWeightsRequest(part=p)
            if barr is not None:
                for p in _parts(pb.TENSOR_BIAS, barr, part_bytes):
                    yield pb.PutWeightsRequest(part=p)

        try:
            r = self._stub.PutWeights(requests(), **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "PutWeights") from None
        return WeightHandle(handle=r.handle, bytes=r.bytes, v=wshape[0], h=wshape[1],
                            dtype=dtype_name(wdt), has_bias=barr is not None)

    def drop_weights(self, handle, *, timeout=None):
        try:
            self._stub.DropWeights(pb.DropWeightsRequest(handle=str(handle)),
                                   **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "DropWeights") from None

    def fetch_gradients(self, accumulator, *, reset=False, response_part_bytes=None,
                        timeout=None):
        """Reads a server-side accumulator (fp32 dW and db); `reset` zeroes it after."""
        rpb = self.response_part_bytes if response_part_bytes is None else response_part_bytes
        req = pb.FetchGradientsRequest(accumulator=accumulator, reset=reset,
                                       response_part_bytes=int(rpb))
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
            raise errors.from_rpc_error(e, "FetchGradients") from None
        if header is None:
            raise errors.ProtocolError("no header in reply", method="FetchGradients")
        t = asm.finish()
        return Gradients(dw=t[pb.TENSOR_DW], db=t.get(pb.TENSOR_DB),
                         micro_batches=header.micro_batches, tokens=header.tokens,
                         instance=header.instance)

    def drop_accumulator(self, accumulator, *, timeout=None):
        try:
            self._stub.DropAccumulator(pb.DropAccumulatorRequest(accumulator=accumulator),
                                       **self._call_kwargs(timeout))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "DropAccumulator") from None

    def compute(self, x, w, targets, *, bias=None, class_weights=None, grad_output=None,
                ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                softcap=None, grad_dtype=None, grad_scale=None, chunk_rows=0,
                want_dx=True, want_dw=True, want_db=None, want_lse=False, want_z_loss=False,
                want_accuracy=False, want_predictions=False, accumulator=None,
                response_part_bytes=None, out=None, timeout=None):
        """Linear + cross-entropy forward and backward on the server.

        x: (BT, H) bf16 / fp16 / fp32 (BF16Array, numpy array, or torch tensor).
        w: (V, H) same dtype as x, or a WeightHandle (or its handle string) from put_weights.
        targets: (BT) int32 or int64 (any integer array is sent as int64).
        bias: (V), inline weights only (a handle carries its own bias).
        class_weights: (V) fp32, PyTorch's cross_entropy `weight`.
        grad_output: (BT) fp32 upstream gradient, reduction "none" only (default ones).
        reduction: "mean" | "sum" | "none". softcap: None or 0 = off.
        grad_dtype: None = the input dtype, or "fp32".
        grad_scale: upstream gradient of the scalar loss (mean, sum); default 1.
        chunk_rows: rows per chunk, 0 = the server chooses.
        want_*: which outputs to return (the loss always is). want_db defaults to "a bias is
          in use". With `accumulator`, dW and db are added to that server-side fp32
          accumulator (created on first use) instead of being returned.
        out: {"dx": array, "dw": ..., "lse": ...} caller buffers (C-contiguous, writable, the
          exact size; a BF16Array or uint16 array for bf16) to receive outputs into without
          a copy; the result then holds those same arrays.
        timeout: seconds (None = the client's default, float("inf") = none).
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
            has_bias = isinstance(w, WeightHandle) and w.has_bias
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
        outs = header.outputs
        outs.dx = bool(want_dx)
        outs.dw = bool(want_dw) and not accumulator
        outs.db = bool(has_bias if want_db is None else want_db) and not accumulator
        outs.lse = bool(want_lse)
        outs.z_loss = bool(want_z_loss)
        outs.accuracy = bool(want_accuracy)
        outs.predictions = bool(want_predictions)
        if accumulator:
            header.accumulator = accumulator
        rpb = self.response_part_bytes if response_part_bytes is None else response_part_bytes
        header.response_part_bytes = int(rpb)
        part_bytes = self.part_bytes

        bytes_sent = sum(arr.nbytes for _, arr in inline)

        def requests():
            yield pb.ComputeRequest(header=header)
            for tid, arr in inline:
                for p in _parts(tid, arr, part_bytes):
                    yield pb.ComputeRequest(part=p)

        into = {}
        by_name = {v: k for k, v in _OUTPUT_NAMES.items()}
        for name, buf in (out or {}).items():
            if name not in by_name:
                raise errors.InvalidArgumentError("out: unknown output %r (one of %s)" % (
                    name, ", ".join(sorted(by_name))))
            into[by_name[name]] = buf.bits if isinstance(buf, BF16Array) else buf
        asm = _Assembler("Compute", into)
        summary = None
        try:
            for msg in self._stub.Compute(requests(), **self._call_kwargs(timeout)):
                kind = msg.WhichOneof("kind")
                if kind == "summary":
                    if summary is not None:
                        raise errors.ProtocolError("two summaries", method="Compute")
                    summary = msg.summary
                    if len(summary.tensors) != len(summary.specs):
                        raise errors.ProtocolError("summary lists %d tensors but %d specs" % (
                            len(summary.tensors), len(summary.specs)), method="Compute")
                    for tid, spec in zip(summary.tensors, summary.specs):
                        asm.expect(tid, spec)
                elif kind == "part":
                    if summary is None:
                        raise errors.ProtocolError("part before summary", method="Compute")
                    asm.add(msg.part)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, "Compute") from None
        if summary is None:
            raise errors.ProtocolError("no summary in reply", method="Compute")
        tensors = asm.finish()
        res = ComputeResult(loss=summary.loss, z_loss=summary.z_loss, accuracy=summary.accuracy,
                            tokens=summary.tokens, compute_seconds=summary.compute_seconds,
                            backend=summary.backend,
                            accumulated_micro_batches=summary.accumulated_micro_batches,
                            wall_seconds=time.perf_counter() - t_start, bytes_sent=bytes_sent,
                            bytes_received=asm.received)
        for tid, value in tensors.items():
            name = _OUTPUT_NAMES.get(tid)
            if name is None:
                raise errors.ProtocolError("unexpected output tensor %d" % tid, method="Compute")
            setattr(res, name, value)
        return res


def connect(target="localhost:50051", **kwargs) -> Client:
    """Client(target, **kwargs)."""
    return Client(target, **kwargs)


__all__ = ["Client", "ComputeResult", "WeightHandle", "Gradients", "ServerInfo", "connect",
           "DEFAULT_PART_BYTES"]
