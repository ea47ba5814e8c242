# SPDX-License-Identifier: Apache-2.0
"""The weights' calls of lossd.Client (put_weights, whole or striped, and drop_weights), a
mixin as lossd._heads is: it uses the client's stubs, part size, striping rule and call
options, and never opens a channel of its own."""

import secrets

import grpc

from lossd import errors
from lossd._proto import pb
from lossd._results import WeightHandle
from lossd._transfer import StripeGroup
from lossd._transfer import parts as _parts
from lossd.tensors import FLOAT_DTYPES, dtype_name, to_wire

# After a stripe hears ABORTED (the server aborted the whole upload and tells every stripe),
# how long the others may take to report before they are cancelled: the stripe that caused the
# abort is then heard with its own error.
_ABORTED_GRACE_S = 1.0


class WeightMethods:
    """put_weights and drop_weights for lossd.Client."""

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
            r = self._unary("PutWeights", requests(header, 0, warr.nbytes, barr is not None),
                            timeout)
            return result(r, 1)
        return result(self._put_weights_striped(header, warr, stripes, requests, barr is not None,
                                                timeout), stripes)

    def _put_weights_striped(self, header, warr, stripes, requests, has_bias, timeout):
        """W's element-aligned byte ranges on `stripes` streams at once under one upload id
        (the bias with the first); returns the first stripe's reply."""
        elems = int(warr.size)
        upload_id = secrets.token_hex(16)
        stubs = self._next_stubs(stripes)
        kws = [self._call_kwargs(timeout) for _ in range(stripes)]  # an id each
        replies = [None] * stripes
        group = StripeGroup(stripes, _ABORTED_GRACE_S)
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
                requests(head, begin, end, i == 0 and has_bias), **kws[i])
            group.register(i, fut)
            try:
                replies[i] = fut.result()
            except grpc.RpcError as e:
                raise errors.from_rpc_error(e, "PutWeights", kws[i]) from None
            except grpc.FutureCancelledError:
                raise errors.CancelledError("cancelled: another stripe failed",
                                            method="PutWeights") from None

        group.run(stripe)
        handles = {r.handle for r in replies}
        if len(handles) != 1:
            raise errors.ProtocolError("stripes of upload %s got different handles: %s" % (
                upload_id, sorted(handles)), method="PutWeights")
        return replies[0]

    def drop_weights(self, handle, *, timeout=None):
        self._unary("DropWeights", pb.DropWeightsRequest(handle=str(handle)), timeout)
