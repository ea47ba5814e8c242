# SPDX-License-Identifier: Apache-2.0
"""The two-phase log-prob in compute() (feature "logprob_two_phase"; lossd.proto's
ComputeHeader.keep_ms and ticket, whose comment is the contract). A forward sets keep_ms: the
server keeps what the backward needs (X, the targets, the weight) under a ticket for that long
and ComputeResult.ticket names it. The backward names the ticket and sends only dlogp and/or
dentropy; the server recomputes the logits from what it kept.

Here only what building those requests needs: keep_ms checked as the wire's uint32, and a
backward's request made without X, W, bias, targets or the options the ticket fixes. Which
calls may take or name a ticket (the kind, no gradients asked of a forward, the same
temperature) are the server's rules, checked once there.
"""

import numbers

from lossd import errors
from lossd._proto import pb

MAX_KEEP_MS = (1 << 32) - 1  # ComputeHeader.keep_ms is a uint32; the server caps it lower
_DEFAULT_IGNORE_INDEX = -100  # compute()'s default, which a backward leaves to its ticket


def check_keep_ms(keep_ms):
    """keep_ms as an int in [0, 2^32 - 1]; 0 (or None) takes no ticket."""
    if keep_ms is None:
        return 0
    if (isinstance(keep_ms, bool) or not isinstance(keep_ms, numbers.Integral)
            or not 0 <= int(keep_ms) <= MAX_KEEP_MS):
        raise errors.InvalidArgumentError(
            "keep_ms must be a whole number of milliseconds in [0, %d] (0 = no ticket), got %r"
            % (MAX_KEEP_MS, keep_ms))
    return int(keep_ms)


class TicketInputs:
    """lossd._compute.Inputs' counterpart for a backward that names a ticket: the header holds
    the ticket and no tensor spec (set_kind adds dlogp and dentropy), and what the reply will
    hold is the ticket's (X's dtype and shape, whether the weight has a bias) and unknown here.

    given: compute()'s tensor and option arguments that a ticket's backward does not send, by
    name; each must be None."""

    def __init__(self, ticket, kind, keep_ms, out, given):
        if not isinstance(ticket, str) or not ticket:
            raise errors.InvalidArgumentError(
                "ticket must be a non-empty string (the forward's ComputeResult.ticket), got %r"
                % (ticket,))
        if kind != "logprob":
            raise errors.InvalidArgumentError(
                "ticket: a ticket's backward is of kind 'logprob' (the two-phase log-prob), got "
                "kind %r" % (kind,))
        if keep_ms:
            raise errors.InvalidArgumentError(
                "keep_ms %d with a ticket: a backward consumes its ticket and takes none "
                "(keep_ms goes with the forward)" % keep_ms)
        sent = sorted(name for name, value in given.items() if value is not None)
        if sent:
            raise errors.InvalidArgumentError(
                "ticket given with %s: a ticket's backward sends only dlogp and/or dentropy "
                "(X, the targets and the weight are the ticket's); pass None for them"
                % ", ".join(sent))
        if out:
            raise errors.InvalidArgumentError(
                "out: a ticket's backward cannot check caller buffers before the reply (its "
                "outputs' dtype and shape are the ticket's); leave out `out`")
        self.header = pb.ComputeHeader(ticket=ticket)
        self.inline = []
        self.xdt = pb.DTYPE_UNSPECIFIED
        self.xshape = ()
        self.wshape = None
        self.has_bias = None  # db is asked for, and comes where the ticket's weight has a bias

    @staticmethod
    def head_fields(head_version, rank, micro_batch):
        """The header's head fields for a ticket taken against a hosted head (the head itself
        is the ticket's): the (rank, micro_batch) key of this backward's contribution to the
        head's step, and the version where given (it must be the forward's)."""
        fields = {}
        if micro_batch is not None:
            if int(rank) < 0 or int(micro_batch) < 0:
                raise errors.InvalidArgumentError(
                    "rank and micro_batch must be >= 0, got %r and %r" % (rank, micro_batch))
            fields.update(rank=int(rank), micro_batch=int(micro_batch))
        elif int(rank) != 0:
            raise errors.InvalidArgumentError(
                "rank %r without micro_batch: a head's backward names both (the key that keeps "
                "a retry from adding twice)" % (rank,))
        if head_version is not None:
            if int(head_version) < 0:
                raise errors.InvalidArgumentError(
                    "head_version must be >= 0, got %r" % (head_version,))
            fields["head_version"] = int(head_version)
        return fields

    @staticmethod
    def finish(header, temperature, ignore_index):
        """Leaves the options the ticket holds unset where the caller gave none (set_kind and
        set_options fill in defaults); a value given is sent, and the server refuses one
        other than the ticket's."""
        if temperature is None:
            header.options.ClearField("temperature")
        if ignore_index == _DEFAULT_IGNORE_INDEX:
            header.options.ClearField("ignore_index")
