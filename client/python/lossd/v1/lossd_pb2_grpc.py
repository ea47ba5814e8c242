# SPDX-License-Identifier: Apache-2.0
"""The lossd.v1.Loss service for grpcio: LossStub (client), LossServicer and
add_LossServicer_to_server (a server, for tests), made from the service's descriptor.

Written by hand instead of by grpcio-tools, whose output refuses a grpcio older than the
generator; this uses only channel and handler calls every grpcio since 1.0 has. Each method's
streaming kinds come from the descriptor, so a new RPC in lossd.proto appears here unaided.
"""

import grpc
from google.protobuf import descriptor_pb2

from lossd.v1 import lossd_pb2

_SERVICE = "lossd.v1.Loss"


def _methods():
    """(name, kind, request class, response class); kind is e.g. 'stream_unary'."""
    fd = descriptor_pb2.FileDescriptorProto.FromString(lossd_pb2.DESCRIPTOR.serialized_pb)
    service = next(s for s in fd.service if s.name == _SERVICE.rsplit(".", 1)[1])
    out = []
    for m in service.method:
        kind = "%s_%s" % ("stream" if m.client_streaming else "unary",
                          "stream" if m.server_streaming else "unary")
        req = getattr(lossd_pb2, m.input_type.rsplit(".", 1)[1])
        resp = getattr(lossd_pb2, m.output_type.rsplit(".", 1)[1])
        out.append((m.name, kind, req, resp))
    return out


_METHODS = _methods()


class LossStub:
    """One callable per RPC, e.g. stub.ServerInfo(request, timeout=...)."""

    def __init__(self, channel):
        for name, kind, req, resp in _METHODS:
            setattr(self, name, getattr(channel, kind)(
                "/%s/%s" % (_SERVICE, name), request_serializer=req.SerializeToString,
                response_deserializer=resp.FromString))


def _unimplemented(name):
    def method(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "%s is not implemented" % name)
    method.__name__ = name
    return method


# Every RPC answers UNIMPLEMENTED until a subclass overrides it.
LossServicer = type("LossServicer", (object,),
                    {name: _unimplemented(name) for name, _, _, _ in _METHODS})


def add_LossServicer_to_server(servicer, server):  # noqa: N802 - grpcio-tools' name
    handlers = {
        name: getattr(grpc, kind + "_rpc_method_handler")(
            getattr(servicer, name), request_deserializer=req.FromString,
            response_serializer=resp.SerializeToString)
        for name, kind, req, resp in _METHODS
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
