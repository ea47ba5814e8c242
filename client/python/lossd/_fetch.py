# SPDX-License-Identifier: Apache-2.0
"""The streams of one fetch_gradients call of the lossd client: the whole accumulator on one
stream, or a one-value look at its size and counters followed by byte ranges of dW | db on
several streams at once, each received straight into place and checked against the wire
contract and the look. The client decides whether to stripe; these decide nothing else.
"""

import grpc
import numpy as np

from lossd import errors
from lossd._proto import pb
from lossd._results import Gradients
from lossd._transfer import (Assembler, RangeReceiver, StripeGroup, check_gradients_header,
                             fetch_ranges_within)


def fetch_whole(client, accumulator, reset, rpb, timeout):
    """The whole accumulator on one stream (`reset` zeroes it after). One refused before its
    header for want of memory goes on in ranges (fetch_striped)."""
    req = pb.FetchGradientsRequest(accumulator=accumulator, reset=reset,
                                   response_part_bytes=int(rpb),
                                   accumulator_instance=client._acc_instance(accumulator))
    asm = Assembler("FetchGradients")
    header = None
    kw = client._call_kwargs(timeout)
    try:
        for msg in client._stub.FetchGradients(req, **kw):
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
        err = errors.from_rpc_error(e, "FetchGradients", kw)
        refused = header is None and isinstance(err, errors.ResourceExhaustedError)
    else:
        refused = False
        err = None
    if refused:
        # Refused before its header (so nothing was reset) for want of memory: it may be
        # larger than the server's whole memory budget, which ranges can fit.
        return fetch_striped(client, accumulator, reset, int(rpb), timeout, refused=err)
    if err is not None:
        raise err
    if header is None:
        raise errors.ProtocolError("no header in reply", method="FetchGradients")
    t = asm.finish()
    return Gradients(dw=t[pb.TENSOR_DW], db=t.get(pb.TENSOR_DB),
                     micro_batches=header.micro_batches, tokens=header.tokens,
                     instance=header.instance)


def fetch_range(client, stub, accumulator, begin, end, rpb, kw, on_header, group=None, i=0):
    """One ranged FetchGradients stream; on_header(header) returns a RangeReceiver."""
    req = pb.FetchGradientsRequest(accumulator=accumulator, response_part_bytes=rpb,
                                   range_begin=begin, range_end=end,
                                   accumulator_instance=client._acc_instance(accumulator))
    header, recv, db_bytes, call = None, None, 0, None
    kw = errors.with_new_request_id(kw)  # each range is a call of its own
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
                _, _, dw_bytes, db_bytes = check_gradients_header(header)
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
        raise errors.from_rpc_error(e, "FetchGradients", kw) from None
    except BaseException:
        if call is not None:
            call.cancel()  # a reply that broke the contract: stop the stream
        raise
    if header is None:
        raise errors.ProtocolError("no header in reply", method="FetchGradients")
    recv.finish()
    return header

def fetch_striped(client, accumulator, reset, rpb, timeout, refused=None):
    """The striped fetch, or None when the accumulator is too small to stripe.

    refused: the ResourceExhaustedError of a whole fetch; then ranges on one stream, as
    many as the server's memory budget needs, or that error where ranges cannot help."""
    kw = client._call_kwargs(timeout)
    look = fetch_range(client, client._stub, accumulator, 0, 4, rpb, kw,
                             lambda h, dw_bytes: RangeReceiver(0, 4, dw_bytes))
    dw_shape, db_shape, dw_bytes, db_bytes = check_gradients_header(look)
    total = dw_bytes + db_bytes
    stripes = 1 if refused is not None else min(client._stripes_for(total), total // 4)
    if stripes <= 1 and refused is None:
        return None

    def ranges_within_budget(refusal):
        try:
            budget = client.server_info(timeout=timeout).memory_budget_bytes
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
    stubs = client._next_stubs(stripes)

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
                    return RangeReceiver(begin, end, n_dw, dw_mv, db_mv)

                fetch_range(client, stubs[i], accumulator, begin, end, rpb, kw, on_header,
                                  group, i)

        group = StripeGroup(stripes, 0.0)
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
        client.drop_accumulator(accumulator, timeout=timeout)
    return Gradients(dw=dw, db=db, micro_batches=look.micro_batches, tokens=look.tokens,
                     instance=look.instance, stripes=stripes, ranges=ranges)
