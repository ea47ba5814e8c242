# SPDX-License-Identifier: Apache-2.0
"""Exceptions of the lossd client: one LossdError subclass per gRPC status code.

Every error carries the gRPC code, the server's message, the method and the call's request
id. Inputs the client can reject before sending raise InvalidArgumentError too (also a
ValueError), so callers handle bad input one way wherever it is caught.
"""

import secrets

import grpc

# Every call carries an id of its own in this metadata key; the server names it in its log
# lines about the call (or makes one where a client sent none) and sends it back.
REQUEST_ID_KEY = "x-request-id"


def new_request_id():
    """16 random lowercase hex digits, new for each call."""
    return secrets.token_hex(8)


def refuse_request_id_in(metadata):
    """A client's own metadata may not fix the request id: InvalidArgumentError."""
    if any(str(k).lower() == REQUEST_ID_KEY for k, _ in metadata):
        raise InvalidArgumentError(
            "metadata x-request-id: the client makes a new one for every call (each error "
            "names it, as the server's log line does); leave it out")


def with_new_request_id(call_kwargs):
    """A copy of a call's keyword arguments (Client._call_kwargs) with a new request id."""
    md = tuple(m for m in call_kwargs.get("metadata") or () if m[0] != REQUEST_ID_KEY)
    return dict(call_kwargs, metadata=md + ((REQUEST_ID_KEY, new_request_id()),))


class LossdError(Exception):
    """A failed lossd call. `code` is a grpc.StatusCode, `message` the server's text,
    `request_id` the call's id (x-request-id), which the server's log lines about the call
    name; None for an error raised before any call was made."""

    code = grpc.StatusCode.UNKNOWN
    request_id = None

    def __init__(self, message, code=None, method=None, request_id=None):
        if code is not None:
            self.code = code
        self.message = message
        self.method = method
        self.request_id = request_id
        where = "%s: " % method if method else ""
        rid = " (request_id %s)" % request_id if request_id else ""
        super().__init__("%s%s: %s%s" % (where, self.code.name, message, rid))

    @property
    def code_name(self):
        return self.code.name


class CancelledError(LossdError):
    code = grpc.StatusCode.CANCELLED


class UnknownError(LossdError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(LossdError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(LossdError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(LossdError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(LossdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(LossdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(LossdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(LossdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(LossdError):
    code = grpc.StatusCode.ABORTED


class OutOfRangeError(LossdError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(LossdError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(LossdError):
    code = grpc.StatusCode.INTERNAL


class UnavailableError(LossdError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLossError(LossdError):
    code = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(LossdError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ClientClosedError(FailedPreconditionError, ValueError):
    """A call on a Client after close(). A ValueError too, as gRPC's own error for a closed
    channel was, so code that caught that keeps working."""


class ArgumentAssertionError(InvalidArgumentError, AssertionError):
    """A bad argument where the Liger-Kernel module lossd replaces checks it with `assert`:
    an AssertionError too, so code (and tests) written against that module catch it as
    before, while lossd callers catch InvalidArgumentError / ValueError as everywhere else."""


class ProtocolError(InternalError):
    """The server's reply broke the wire contract (parts out of order, sizes wrong)."""


class StepLostError(AbortedError):
    """A replica pool lost an accumulator's partial step (its replica died or restarted, or
    a call's outcome is unknown): drop the accumulator and redo the step's micro-batches.
    `accumulator`, `replica` (where it was) and `moved_to` (where the redo goes)."""

    def __init__(self, message, accumulator=None, replica=None, moved_to=None, method=None):
        super().__init__(message, method=method)
        self.accumulator, self.replica, self.moved_to = accumulator, replica, moved_to


class HeadLostError(AbortedError):
    """A replica pool lost a hosted head (its replica died or restarted): the head must be
    imported from its last export, by `import_rank` (ImportHead is idempotent by head and
    version, so other ranks may repeat it), and the step redone. `head`, `replica`,
    `moved_to` (where the import goes)."""

    def __init__(self, message, head=None, replica=None, moved_to=None, import_rank=0,
                 method=None):
        super().__init__(message, method=method)
        self.head, self.replica, self.moved_to = head, replica, moved_to
        self.import_rank = import_rank


class WeightsChangedError(FailedPreconditionError):
    """A replica pool must upload named weights again (their handle was lost with its
    replica) but the caller's tensors no longer hold the bytes first uploaded: give W again
    (ReplicaPool.put_weights with the same name). `name`."""

    def __init__(self, message, name=None, method=None):
        super().__init__(message, method=method)
        self.name = name


_BY_CODE = {
    cls.code: cls
    for cls in (
        CancelledError,
        UnknownError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}


def _metadata_value(metadata, key):
    for k, v in metadata or ():
        if k == key:
            return v
    return None


def request_id_of(err, call_kwargs=None):
    """The call's request id: the one the server sent back (its initial metadata, or the
    trailing metadata of a reply that was only a status), else the one the call sent
    (`call_kwargs`' metadata; the server never answered), else None."""
    for name in ("initial_metadata", "trailing_metadata"):
        get = getattr(err, name, None)
        if get is None:
            continue
        try:
            rid = _metadata_value(get(), REQUEST_ID_KEY)
        except Exception:  # noqa: BLE001: an error object without live metadata
            rid = None
        if rid:
            return rid
    if call_kwargs:
        return _metadata_value(call_kwargs.get("metadata"), REQUEST_ID_KEY)
    return None


def from_rpc_error(err, method=None, call_kwargs=None):
    """Turns a grpc.RpcError into the matching LossdError subclass, naming the call's request
    id (request_id_of; `call_kwargs`: what the call was made with, Client._call_kwargs)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, LossdError)
    return cls(details or "", code=code, method=method,
               request_id=request_id_of(err, call_kwargs))
