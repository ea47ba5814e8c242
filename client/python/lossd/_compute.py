# SPDX-License-Identifier: Apache-2.0
"""One compute() call of the lossd client, apart from the transport: the ComputeHeader and the
tensors it sends (small ones first, X last), the checks of caller output buffers made before
anything is sent, and the reading of the reply's summaries and parts into a ComputeResult.
Opens no call of its own and never retries.
"""

import numpy as np

from lossd import errors
from lossd._proto import pb
from lossd._kinds import kind_outputs
from lossd._results import ComputeResult, WeightHandle
from lossd._wire import encoded_parts
from lossd.tensors import (FLOAT_DTYPES, INT_DTYPES, BF16Array, dtype_name, numpy_dtype,
                           parse_dtype, to_wire)

REDUCTIONS = {"mean": pb.REDUCTION_MEAN, "sum": pb.REDUCTION_SUM, "none": pb.REDUCTION_NONE}

OUTPUT_NAMES = {
    pb.TENSOR_LOSS: "per_token_loss",
    pb.TENSOR_LSE: "lse",
    pb.TENSOR_Z_LOSS: "per_token_z_loss",
    pb.TENSOR_PREDICTIONS: "predictions",
    pb.TENSOR_DX: "dx",
    pb.TENSOR_DW: "dw",
    pb.TENSOR_DB: "db",
    pb.TENSOR_LOGP: "logp",
    pb.TENSOR_ENTROPY: "entropy",
}


class Inputs:
    """The tensors of one compute: the header's specs, and (tensor id, array) in the order
    they are sent (small first, X last, so the server can start computing early)."""

    def __init__(self, x, w, targets, bias, class_weights, grad_output, reduction):
        if reduction not in REDUCTIONS:
            raise errors.InvalidArgumentError(
                "reduction must be 'mean', 'sum' or 'none', got %r" % (reduction,))
        handle = None
        head = w is None  # a hosted head's compute: the server holds the weights
        if isinstance(w, (WeightHandle, str)):
            handle = str(w)
            if bias is not None:
                raise errors.InvalidArgumentError(
                    "bias given with a weight handle: the handle carries its own bias")
        xdt, xshape, xarr = to_wire(x, "x", FLOAT_DTYPES)
        header = pb.ComputeHeader(x=pb.TensorSpec(dtype=xdt, shape=xshape))
        inline = []
        if targets is not None:  # None: kind distill, where they only mark ignored rows
            tdt, tshape, tarr = to_wire(targets, "targets", INT_DTYPES)
            header.targets.CopyFrom(pb.TensorSpec(dtype=tdt, shape=tshape))
            inline.append((pb.TENSOR_TARGETS, tarr))
        if head:
            has_bias, wshape = None, None
        elif handle is not None:
            header.weight_handle = handle
            # A bare handle string does not say: db is asked for, and comes only with a bias.
            has_bias = w.has_bias if isinstance(w, WeightHandle) else None
            wshape = (w.v, w.h) if isinstance(w, WeightHandle) else None
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
        if handle is None and not head:
            inline.append((pb.TENSOR_W, warr))
        inline.append((pb.TENSOR_X, xarr))
        self.header, self.inline = header, inline
        self.xdt, self.xshape = xdt, xshape
        self.wshape = wshape  # None behind a bare handle string
        self.has_bias = has_bias  # None: a bare handle string, which may carry one


def compute_requests(header, inline, part_bytes):
    """The request stream as wire bytes (lossd._wire.compute_call sends them as they are):
    the header, then each tensor's parts in `inline`'s order."""
    yield pb.ComputeRequest(header=header).SerializeToString()
    for tid, arr in inline:
        yield from encoded_parts(tid, arr, part_bytes)


def set_options(header, xdt, *, ignore_index, reduction, label_smoothing, lse_square_scale,
                softcap, grad_dtype, grad_scale, chunk_rows, token_scaling):
    """The header's LossOptions from compute()'s arguments."""
    opts = header.options
    opts.ignore_index = int(ignore_index)
    opts.reduction = REDUCTIONS[reduction]
    opts.label_smoothing = float(label_smoothing)
    opts.lse_square_scale = float(lse_square_scale)
    opts.softcap = float(softcap or 0.0)
    gd = parse_dtype(grad_dtype)
    if gd not in (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FP32, xdt):
        raise errors.InvalidArgumentError(
            "grad_dtype must be the input dtype (%s) or fp32, got %s" % (
                dtype_name(xdt) if xdt else "None: a ticket's backward does not know it",
                dtype_name(gd)))
    opts.grad_dtype = pb.DTYPE_UNSPECIFIED if gd == xdt else gd
    if grad_scale is not None:
        opts.grad_scale = float(grad_scale)
    opts.chunk_rows = int(chunk_rows)
    opts.token_scaling = bool(token_scaling)


def set_outputs(header, has_bias, accumulator, *, want_dx, want_dw, want_db, want_lse,
                want_z_loss, want_accuracy, want_predictions):
    """The header's wanted Outputs; dW and db never with an accumulator or a head (`accumulator`
    is either name: the gradients add to it)."""
    outs = header.outputs
    outs.dx = bool(want_dx)
    outs.dw = bool(want_dw) and not accumulator
    outs.db = bool((has_bias is not False) if want_db is None else want_db) and not accumulator
    outs.lse = bool(want_lse)
    outs.z_loss = bool(want_z_loss)
    outs.accuracy = bool(want_accuracy)
    outs.predictions = bool(want_predictions)


def returned_outputs(header, xdt, xshape, wshape, has_bias):
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
    got.update(kind_outputs(header, bt))
    return got



def check_out(out, returned):
    """{tensor id: caller buffer} from compute()'s `out`, each checked against `returned`
    (returned_outputs). Checked before anything is sent: found wrong once the server has
    answered, a micro-batch would already be in its accumulator, and a retry would add it
    twice."""
    into = {}
    by_name = {v: k for k, v in OUTPUT_NAMES.items()}
    for name, buf in (out or {}).items():
        if name not in by_name:
            raise errors.InvalidArgumentError("out: unknown output %r (one of %s)" % (
                name, ", ".join(sorted(by_name))))
        arr = buf.bits if isinstance(buf, BF16Array) else buf
        if name not in returned:
            raise errors.InvalidArgumentError(
                "out[%r]: this call does not return %s (see want_*, kind and accumulator)" % (
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
    return into


class ReplyReader:
    """Reads one Compute reply into an Assembler. Without overlap: the summary, then the
    parts. With overlap: a preliminary summary that announces the outputs, the parts, then the
    final summary last."""

    def __init__(self, asm, overlapped):
        self.asm = asm
        self.overlapped = overlapped
        self.announced = None  # the summary that listed the outputs
        self.summary = None  # the one with the results

    def add(self, msg):
        kind = msg.WhichOneof("kind")
        if kind == "summary":
            self._summary(msg.summary)
        elif kind == "part":
            if self.announced is None:
                raise errors.ProtocolError("part before summary", method="Compute")
            if self.overlapped and self.summary is not None:
                raise errors.ProtocolError("part after the final summary", method="Compute")
            self.asm.add(msg.part)

    def _summary(self, s):
        if self.summary is not None:
            raise errors.ProtocolError("two summaries", method="Compute")
        if len(s.tensors) != len(s.specs):
            raise errors.ProtocolError("summary lists %d tensors but %d specs" % (
                len(s.tensors), len(s.specs)), method="Compute")
        if s.preliminary != (self.overlapped and self.announced is None):
            raise errors.ProtocolError(
                "a %s summary where a %s one was due" % (
                    "preliminary" if s.preliminary else "final",
                    "final" if s.preliminary else "preliminary"), method="Compute")
        if self.announced is None:
            self.announced = s
            for tid, spec in zip(s.tensors, s.specs):
                self.asm.expect(tid, spec)
        elif list(s.tensors) != list(self.announced.tensors):
            raise errors.ProtocolError(
                "the final summary lists other outputs than the preliminary one",
                method="Compute")
        if not s.preliminary:
            self.summary = s

    def finish(self):
        """The final summary, after the stream ended well."""
        if self.summary is None:
            raise errors.ProtocolError(
                "no final summary in reply" if self.announced is not None else
                "no summary in reply", method="Compute")
        return self.summary


def result_of(summary, tensors, into, *, wall_seconds, bytes_sent, bytes_received):
    """The ComputeResult of a final summary and the received tensors {tensor id: array}."""
    unfilled = sorted(OUTPUT_NAMES[t] for t in into if t not in tensors)
    if unfilled:
        # Possible only where the request could not tell: db behind a bare handle string
        # whose weights carry no bias.
        raise errors.InvalidArgumentError(
            "out: the server returned no %s for this call, so the buffer given for it was "
            "not written" % ", ".join(unfilled), method="Compute")
    return ComputeResult(loss=summary.loss, z_loss=summary.z_loss, accuracy=summary.accuracy,
                         tokens=summary.tokens, compute_seconds=summary.compute_seconds,
                         backend=summary.backend,
                         accumulated_micro_batches=summary.accumulated_micro_batches,
                         wall_seconds=wall_seconds, bytes_sent=bytes_sent,
                         bytes_received=bytes_received, instance=summary.instance,
                         nonfinite=[OUTPUT_NAMES.get(t, str(t)) for t in summary.nonfinite],
                         head_version=summary.head_version, head_added=summary.head_added,
                         kl=summary.kl, clip_fraction=summary.clip_fraction,
                         ticket=summary.ticket,
                         ticket_expires_unix_ms=summary.ticket_expires_unix_ms)


def set_outputs_of(res, tensors):
    """The received tensors onto the result, by output name."""
    for tid, value in tensors.items():
        name = OUTPUT_NAMES.get(tid)
        if name is None:
            raise errors.ProtocolError("unexpected output tensor %d" % tid, method="Compute")
        setattr(res, name, value)
